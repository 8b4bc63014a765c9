"""The orchestrator's data step, run as ``python -m launch.datatool`` (the orchestrator imports no
datasets or transformers): prepares the training (and validation) data into a cache, checks it
against the model and prints what the run will see as one JSON object on stdout.

    echo '{"data": {...DataPart...}, "tokenizer": "model", "cache_root": "RUN/data-cache",
           "seed": 0, "vocab_size": 384, "show": 2}' | python -m launch.datatool

Output: ``{"stats": read_stats(...), "validation": stats or null, "rows": [{"text", "target",
"input_ids", "target_ids"}, ...]}`` (``rows``: the first ``show`` training rows in the run's order;
``text`` and ``target`` are null without a tokenizer). Exit 2 with the ``DataError`` on stderr
when the data does not fit the schedule or the model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from launch import records
from launch.contract.spec import DataPart
from launch.dataprep import IGNORE, DataError, load_tokenizer, prepare, read_stats
from shard_tools.tokenizer import TOKENIZER_FILES


def inspect(req: dict[str, Any]) -> dict[str, Any]:
    """Prepares and checks the data of one request (the module docstring's object)."""
    from launch.data import SampleOrder, load_examples, training_rows

    data = DataPart.model_validate(req["data"])
    tokenizer, root = req.get("tokenizer"), Path(req["cache_root"])
    reuse = tuple(Path(p) for p in req.get("reuse", ()))
    if data.format != "tokens":
        _check_tokenizer(data, tokenizer)
    vocab = req.get("vocab_size")
    cache = prepare(data, tokenizer, root, reuse, vocab_size=vocab)
    check(data, cache, vocab)
    out: dict[str, Any] = {"stats": read_stats(cache), "validation": None, "rows": []}
    if data.validation_path:
        val = data.model_copy(update={"path": data.validation_path})
        val_cache = prepare(val, tokenizer, root, reuse, vocab_size=vocab)
        check(val, val_cache, vocab, "data.validation_path")
        out["validation"] = read_stats(val_cache)
    if req.get("show"):
        examples = load_examples(cache)
        order = SampleOrder(len(examples), req.get("seed", 0), data.shuffle)
        tok = _decoder(data, tokenizer)
        for ids, labels in training_rows(examples, order, req["show"]):
            targets = [t for t in labels[1:] if t != IGNORE]
            out["rows"].append({"text": tok.decode(ids) if tok else None,
                                "target": tok.decode(targets) if tok else None,
                                "input_ids": ids, "target_ids": targets})
    return out


def check(data: DataPart, cache: Path, vocab_size: int | None, key: str = "data.path") -> None:
    """Rows that the model can take and learn from: at least one target token (``key`` names the
    data), every token id and target below its vocabulary size (the first offending record named
    where rows are records). ``seq_len`` against the model's positions is the schedule's check
    (``orchestrator.validate``), made before this runs."""
    import numpy as np

    from launch.data import load_examples

    no_targets(data, read_stats(cache), key)
    if not vocab_size:
        return
    ex = load_examples(cache)
    bad = (ex.input_ids >= vocab_size).any(axis=1) | ((ex.labels >= vocab_size) & (ex.labels != IGNORE)).any(axis=1)
    if bad.any():
        row = int(np.argmax(bad))
        top = int(max(ex.input_ids[row].max(), ex.labels[row].max()))
        path = Path(data.path).resolve()
        where = {"row": row} if data.packs or path.is_dir() else records.where(path, row)
        if "row" in where:
            raise DataError(f"row {row}: token id {top} is not below the model's vocab_size {vocab_size} (config.json)",
                            str(path))
        raise DataError(f"token id {top} is not below the model's vocab_size {vocab_size} (config.json)", str(path),
                        **where)


def no_targets(data: DataPart, stats: dict[str, Any], key: str) -> None:
    """DataError where no token carries loss: a run would train on nothing (loss 0.0) and end well."""
    if stats["target_tokens"]:
        return
    why = {"tokens": f"every label is -100 or a row's first (data.seq_len = {data.seq_len}), which nothing predicts",
           "text": f"every row is one token long (data.seq_len = {data.seq_len})"}.get(
        data.format, f"no assistant turn is rendered within data.seq_len = {data.seq_len} (a template that renders "
                     f"none, or prompts that fill every row: {stats['truncated']} of {stats['examples']} examples cut)")
    raise DataError(f"{key}: no target tokens, nothing to train on: {why}", str(Path(data.path).resolve()))


def _check_tokenizer(data: DataPart, tokenizer: str | None) -> None:
    """A tokenizer that does not load is bad input (exit 2), not a fault of the preparation."""
    try:
        load_tokenizer(data, tokenizer)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for broken files
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"model.tokenizer: cannot load a tokenizer from {tokenizer}: {type(e).__name__}: {first}") \
            from None


def _decoder(data: DataPart, tokenizer: str | None):
    """The tokenizer for showing rows; tokens data shows ids alone where there is none."""
    if data.format != "tokens":
        return load_tokenizer(data, tokenizer)
    if tokenizer and any((Path(tokenizer) / f).is_file() for f in TOKENIZER_FILES):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(tokenizer)
    return None


def main() -> None:
    from launch.procs import set_parent_death_signal

    set_parent_death_signal()  # a stopped orchestrator leaves no preparation behind
    os.register_at_fork(after_in_child=set_parent_death_signal)  # nor datasets.map workers of this one
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        out = inspect(json.loads(sys.stdin.read()))
    except DataError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
