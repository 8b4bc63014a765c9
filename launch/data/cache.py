"""Prepare once: read each source with Hugging Face ``datasets``, render and tokenize it in parallel,
hold out and draw its examples, mix them into one seeded order, lay them into ``seq_len`` rows and
write the rows to a cache every process maps.

    cache = prepare(data, tokenizer_dir, run_dir / "data-cache")   # idempotent, safe to race
    read_stats(cache)                                              # {"train": {...}, "sources": [...], ...}

A cache entry ``<cache_root>/<key>/`` holds ``rows.safetensors`` (int32 ``input_ids`` and
``labels`` [rows, seq_len], int32 ``lengths`` [rows] (tokens before the padding), ``targets``
[rows] (tokens that carry loss: ``labels[1:] != -100``) and, for examples packed whole,
``positions`` [rows, seq_len]), ``validation.safetensors`` alike where the data holds some out,
``records.safetensors`` (each record's largest token id, for the vocabulary check) and
``stats.json``. The key is every source's identity (resolved path, size, mtime_ns: no full-file
hash) and options, the tokenizer files' digest and every data option, so an edited file or another
option is another entry. Labels are aligned as in Hugging Face: the model shifts them, -100 carries
no loss.

Formats (``launch.data.formats``): ``tokens``, ``text``, ``instruction``, ``chat``. A record that does
not fit its format is a ``DataError`` naming the file and line (jsonl, json lines, csv) or record
index.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from launch.data import mix, rows as layouts
from launch.contract.data import ALPACA_PROMPT, DataPart, SourcePart
from launch.data.formats import MARKINGS, Encoder, StoppedAt
from launch.data.records import DataError, find_bad_record, read_records, where
from launch.data.rows import IGNORE, gather, ragged, starts_of
from launch.data.template import TemplateFault
from launch.data.templates import check_markers, template_text
from shard_tools.tokenizer import TOKENIZER_FILES

__all__ = ["IGNORE", "ROWS", "VALIDATION", "DataError", "cache_key", "cached", "load_tokenizer", "prepare",
           "read_stats"]

CACHE_VERSION = 2
"""Part of every cache key: bump it when the rows prepared from the same input change."""
ROWS, VALIDATION, RECORDS, STATS = "rows.safetensors", "validation.safetensors", "records.safetensors", "stats.json"
PARALLEL_FROM = 20_000
"""Records from which tokenizing runs in several processes (below it, starting them costs more)."""


# -- the cache ---------------------------------------------------------------------------------
def prepare(data: DataPart, tokenizer: str | None, cache_root: Path, reuse: tuple[Path, ...] = (), *,
            vocab_size: int | None = None) -> Path:
    """The cache directory of ``data`` as ``tokenizer`` renders it, made if missing: idempotent.
    ``reuse``: other caches (a run's, read only) whose entry of the same key is taken as it is.

    Concurrent callers (the ranks of a phase, pre-warmed phases) serialise on a lock of the cache
    folder itself (no lock files), so the data is prepared once; the entry is written to a temporary
    directory and renamed into place. Under the lock no other preparation runs, so any temporary
    there is a killed one's: it goes. ``tokenizer`` (a Hugging Face tokenizer directory) is needed by
    every format but ``tokens``. ``vocab_size``: the model's, which every token id of ``tokens``
    data must be below (named by its record). Raises ``DataError`` (nothing is left in the cache then)."""
    key = cache_key(data, tokenizer)
    made = _entry(key, cache_root, reuse)
    if made is not None:
        return made
    out = Path(cache_root) / key
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _made(out):
            return out
        for left in out.parent.iterdir():  # killed preparations; lock files of relayer < 2026-12
            if left.name.startswith((".tmp-", ".lock-")):
                shutil.rmtree(left) if left.is_dir() and not left.is_symlink() else left.unlink(missing_ok=True)
        tmp = out.parent / f".tmp-{key}-{os.getpid()}"
        tmp.mkdir()
        try:
            _build(data, tokenizer, tmp, vocab_size)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.close(fd)
    return out


def cached(data: DataPart, tokenizer: str | None, cache_root: Path, reuse: tuple[Path, ...] = ()) -> Path | None:
    """The entry of ``data`` made already, in one of ``reuse`` or in ``cache_root``; None where there is none.
    It was made with this tokenizer and template (their texts are in the key): it loaded them then."""
    return _entry(cache_key(data, tokenizer), cache_root, reuse)


def _entry(key: str, cache_root: Path, reuse: tuple[Path, ...]) -> Path | None:
    return next((Path(root) / key for root in (*reuse, cache_root) if _made(Path(root) / key)), None)


def _made(entry: Path) -> bool:
    """Whether a cache entry is there (its stats are written last); DataError where its files are
    not files (a FIFO would block every process that maps the rows)."""
    if not (entry / STATS).exists():
        return False
    for name in (STATS, ROWS):
        if not (entry / name).is_file():
            raise DataError(f"{entry / name}: not a file, where the data cache keeps its rows; remove {entry}")
    return True


def read_stats(cache_dir: Path) -> dict[str, Any]:
    """``stats.json`` of a cache entry: ``layout`` and ``seq_len``; ``train`` and ``validation``
    (null without), each with examples, tokens (of the examples, before the layout), target_tokens
    (tokens that carry loss, in the rows), truncated (examples cut to seq_len), dropped_tokens,
    rows, padding_tokens, rows_without_targets; ``sources`` and ``validation_files``, one object a
    file (key, path, format, weight, records, held_out, examples, tokens, target_tokens, truncated,
    without_targets (examples none of whose tokens carries loss in its row), template, marking:
    ``_source_stats``)."""
    return json.loads((Path(cache_dir) / STATS).read_text())


def cache_key(data: DataPart, tokenizer: str | None) -> str:
    h = hashlib.sha256(json.dumps({
        "v": CACHE_VERSION, "sources": [_source_key(s) for s in data.sources],
        "validation": [_source_key(s) for s in data.validation], "split": data.validation_split, "seed": data.seed,
        "shuffle": data.shuffle, "seq_len": data.seq_len, "layout": data.layout}, sort_keys=True).encode())
    if tokenizer and any(s.format != "tokens" for s in (*data.sources, *data.validation)):
        for name in TOKENIZER_FILES:
            f = Path(tokenizer) / name
            if f.is_file():
                h.update(name.encode() + f.read_bytes())
    return h.hexdigest()[:20]


def _source_key(s: SourcePart) -> dict[str, Any]:
    path = Path(s.path).resolve()
    return {"path": str(path), "file": _identity(path), "format": s.format, "train_on_prompt": s.train_on_prompt,
            "fields": s.fields, "weight": s.weight, "template": template_text(s) if s.format != "tokens" else None}


def _identity(path: Path) -> list:
    if path.is_dir():
        return sorted([str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns]
                      for f in path.rglob("*") if f.is_file())
    try:
        st = path.stat()
    except OSError:
        raise DataError("no such data file", str(path)) from None
    return [st.st_size, st.st_mtime_ns]


# -- encoding a source -------------------------------------------------------------------------
@dataclass
class Encoded:
    """A source's records, tokenized: flat ids and labels, each record's length and largest id."""

    source: SourcePart
    ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    max_ids: np.ndarray
    template: str | None
    """The chat template it was rendered with, in words (None: a format without one)."""
    markings: list[str]
    """How its assistant turns were found (``launch.data.chat``), every way that some record needed."""

    @property
    def starts(self) -> np.ndarray:
        return starts_of(self.lengths)


def encode_source(source: SourcePart, tokenizer: str | None, hf_cache: Path,
                  vocab_size: int | None = None) -> Encoded:
    """Every record of ``source`` as tokens and labels; a record that does not fit is a DataError."""
    path = Path(source.path).resolve()
    tok = load_tokenizer(source, tokenizer) if source.format != "tokens" else None
    try:
        encode = Encoder(source, tok, vocab_size)
    except TemplateFault as e:
        raise DataError(str(e)) from None
    ds = read_records(source, path, hf_cache, encode.check)
    if len(ds) == 0:
        raise DataError("no examples", str(path))
    enc = _encode_all(encode, ds, path)
    ids, lengths = ragged(enc, "input_ids")
    labels, _ = ragged(enc, "labels")
    starts = starts_of(lengths)
    max_ids = np.maximum(np.maximum.reduceat(ids, starts), np.maximum.reduceat(labels, starts)).astype(np.int32)
    markings = [MARKINGS[m] for m in sorted(set(enc["marking"])) if m]
    return Encoded(source, ids, labels, lengths, max_ids, _template_in_words(source, tok), markings)


def _encode_all(encode: Encoder, ds, path: Path):
    """Every record rendered and tokenized (``datasets.map``, in worker processes for many); the
    first record at fault raises ``DataError`` naming its line."""
    num_proc = min(8, os.cpu_count() or 1) if len(ds) >= PARALLEL_FROM else None
    try:
        enc = ds.map(encode, batched=True, batch_size=256, with_indices=True, num_proc=num_proc,
                     remove_columns=ds.column_names, desc=None)
    except UnicodeDecodeError:
        # pyarrow's JSON reader keeps invalid bytes; they fail when the strings are read here.
        find_bad_record(path, encode.check)
        raise DataError("not UTF-8", str(path)) from None
    except StoppedAt as e:  # the template's budget: one record named, the rest not rendered
        raise DataError(e.args[0], str(path), **where(path, e.args[1])) from None
    bad = [i for i, e in enumerate(enc["error"]) if e]
    if bad:
        # JSON read as columns: one float id makes every record's ids floats; the lines tell.
        find_bad_record(path, encode.check)
        raise DataError(enc[bad[0]]["error"], str(path), **where(path, bad[0]))
    return enc


def _template_in_words(source: SourcePart, tok) -> str | None:
    if source.format in ("tokens", "text"):
        return None
    t = source.chat_template
    if t is not None:
        return t if "{" not in t else "inline"
    return "the tokenizer's" if tok.chat_template else "none: the Alpaca prompt"


def load_tokenizer(source: SourcePart, tokenizer: str | None):
    """The fast tokenizer of ``tokenizer`` (with ``source.chat_template`` set over its own)."""
    import transformers

    if not tokenizer or not any((Path(tokenizer) / f).is_file() for f in TOKENIZER_FILES):
        raise DataError(f'{source.key}: format = "{source.format}" needs a tokenizer: model.tokenizer (default '
                        f"model.path) {tokenizer or '(none)'} has no tokenizer files")
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=False)
    if not tok.is_fast:
        raise DataError("expected a fast tokenizer (tokenizer.json); this one is slow", tokenizer)
    template = template_text(source)
    if template is not None:
        tok.chat_template = template
        check_markers(source, tok)
    if source.chat_template == ALPACA_PROMPT:
        if source.format != "instruction":
            raise DataError(f'{source.key}.chat_template: "{ALPACA_PROMPT}" (the Alpaca prompt) is for '
                            f'format = "instruction", not "{source.format}"')
        tok.chat_template = None
    if source.format == "chat" and not tok.chat_template:
        raise DataError(f'{source.key}: format = "chat" needs a chat template: the tokenizer has none; set '
                        f"{source.key}.chat_template", tokenizer)
    return tok


# -- building an entry -------------------------------------------------------------------------
def _build(data: DataPart, tokenizer: str | None, out: Path, vocab_size: int | None = None) -> None:
    from safetensors.numpy import save_file

    sources = [encode_source(s, tokenizer, out / "hf-cache", vocab_size) for s in data.sources]
    files = [encode_source(s, tokenizer, out / "hf-cache", vocab_size) for s in data.validation]
    shutil.rmtree(out / "hf-cache", ignore_errors=True)
    train_picks, held_picks = [], []
    for i, enc in enumerate(sources):
        train, held = _split(data, enc, i)
        train_picks.append(mix.draws(train, enc.source.weight, data.seed, i))
        held_picks.append(held)
    held_picks += [np.arange(len(f.lengths)) for f in files]
    stats: dict[str, Any] = {"layout": data.layout, "seq_len": data.seq_len}
    stats["sources"] = [_source_stats(data, e, p, len(h)) for e, p, h in zip(sources, train_picks, held_picks)]
    stats["validation_files"] = [_source_stats(data, f, np.arange(len(f.lengths)), 0) for f in files]
    # Rows are drawn in a seeded order anyway (launch.data.examples.SampleOrder); packing whole takes the
    # examples shuffled too, so that a row mixes sources and lengths.
    order = mix.mixed(sum(len(p) for p in train_picks), data.seed, data.shuffle and data.layout == "whole")
    stats["train"] = _write_rows(data, sources, train_picks, order, out / ROWS)
    everything = sources + files
    total = sum(len(p) for p in held_picks)
    stats["validation"] = _write_rows(data, everything, held_picks, np.arange(total), out / VALIDATION,
                                      by_source=len(everything) > 1) if total else None
    save_file({f"max_id.{i}": e.max_ids for i, e in enumerate(everything)}, str(out / RECORDS))
    for name in (ROWS, VALIDATION, RECORDS):
        if (out / name).exists():
            _as_umask_allows(out / name)
    (out / STATS).write_text(json.dumps(stats, indent=1) + "\n")


def _split(data: DataPart, enc: Encoded, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) records of source ``index``; one left with nothing to train on is refused."""
    n, s = len(enc.lengths), enc.source
    train, held = mix.split(n, data.validation_split, data.seed, index)
    if not len(train):
        raise DataError(f"data.validation_split = {data.validation_split} holds out {len(held)} of {s.key}'s {n} "
                        "records: none is left to train on", str(Path(s.path).resolve()))
    if mix.drawn_count(len(train), s.weight) == 0:
        raise DataError(f"{s.key}.weight = {s.weight} draws none of its {len(train)} training examples",
                        str(Path(s.path).resolve()))
    if (drawn := mix.drawn_count(len(train), s.weight)) > mix.MAX_DRAWN:
        raise DataError(f"{s.key}.weight = {s.weight:g} draws {drawn:,} examples an epoch from its {len(train):,}: "
                        f"expected at most {mix.MAX_DRAWN:,}", str(Path(s.path).resolve()))
    return train, held


def _source_stats(data: DataPart, enc: Encoded, picks: np.ndarray, held: int) -> dict[str, Any]:
    """One source's part: its records, held out and drawn, and its drawn examples' tokens and
    targets as a row of their own would hold them (cut to seq_len, except in a stream)."""
    s, lengths = enc.source, enc.lengths[picks]
    kept = lengths if data.layout == "stream" else np.minimum(lengths, data.seq_len)
    counted = np.concatenate([[0], np.cumsum(enc.labels != IGNORE)])
    starts = enc.starts[picks]
    targets = counted[starts + kept] - counted[starts + 1]  # a row's first token is never a target
    return {"key": s.key, "path": str(Path(s.path).resolve()), "format": s.format, "weight": s.weight,
            "records": len(enc.lengths), "held_out": held, "examples": len(picks), "tokens": int(lengths.sum()),
            "target_tokens": int(targets.sum()), "truncated": int((lengths > kept).sum()),
            "without_targets": int((targets == 0).sum()), "template": enc.template, "marking": enc.markings}


def _write_rows(data: DataPart, encs: list[Encoded], picks: list[np.ndarray], order: np.ndarray,
                path: Path, by_source: bool = False) -> dict[str, Any]:
    """The examples ``picks`` of ``encs`` in ``order``, laid into rows and saved to ``path``; their
    stats. ``by_source``: also ``sources``, the index in ``encs`` of each target token's source
    (-100 elsewhere), for an evaluation loss per source (the source names in the stats)."""
    from safetensors.numpy import save_file

    base = np.cumsum([0] + [len(e.ids) for e in encs])[:-1]
    starts = np.concatenate([b + e.starts[p] for b, e, p in zip(base, encs, picks)])[order]
    lengths = np.concatenate([e.lengths[p] for e, p in zip(encs, picks)])[order]
    ids = gather(np.concatenate([e.ids for e in encs]), starts, lengths)
    labels = gather(np.concatenate([e.labels for e in encs]), starts, lengths)
    stats: dict[str, Any] = {"examples": len(lengths), "tokens": int(lengths.sum())}
    layout = {"pad": layouts.pad, "stream": layouts.stream, "whole": layouts.whole}[data.layout]
    input_ids, row_labels, row_lengths, positions = layout(ids, labels, lengths, data.seq_len, stats)
    if len(input_ids) == 0:
        raise DataError(f"{stats['tokens']} tokens, fewer than one example of data.seq_len = {data.seq_len}",
                        ", ".join(str(Path(e.source.path).resolve()) for e in encs))
    targets = (row_labels[:, 1:] != IGNORE).sum(axis=1).astype(np.int32)
    stats.update(rows=len(input_ids), target_tokens=int(targets.sum()),
                 padding_tokens=int(data.seq_len * len(input_ids) - row_lengths.sum()),
                 rows_without_targets=int((targets == 0).sum()))
    tensors = {"input_ids": input_ids, "labels": row_labels, "lengths": row_lengths, "targets": targets}
    if by_source:  # the same layout again, each target token's label its source: the same places
        of = np.repeat(np.concatenate([np.full(len(p), i, np.int32) for i, p in enumerate(picks)])[order], lengths)
        tensors["sources"] = layout(ids, np.where(labels != IGNORE, of, IGNORE).astype(np.int32), lengths,
                                    data.seq_len, {})[1]
        stats["source_names"] = source_names([e.source for e in encs])
    save_file(tensors | ({"positions": positions} if positions is not None else {}), str(path))
    return stats


def source_names(sources: list[SourcePart]) -> list[str]:
    """Each source's name in the metrics (``eval_loss/NAME``): its file's stem, with its index where
    two share one."""
    stems = [Path(s.path).stem for s in sources]
    return [stem if stems.count(stem) == 1 else f"{stem}-{i}" for i, stem in enumerate(stems)]


def _as_umask_allows(path: Path) -> None:
    """safetensors creates its files 0600 whatever the umask; the run's umask decides (run.group_readable)."""
    mask = os.umask(0o077)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
