"""The orchestrator's data step, run as ``python -m launch.data.tool`` (the orchestrator imports no
datasets or transformers): prepares the training and validation data into a cache, checks it
against the model and prints what the run will see as one JSON object on stdout.

    echo '{"data": {...DataPart...}, "tokenizer": "model", "cache_root": "RUN/data-cache",
           "vocab_size": 384, "show": 2}' | python -m launch.data.tool

Output: ``{"stats": read_stats(...), "rows": [{"text", "target", "input_ids", "target_ids"}, ...]}``
(``rows``: the first ``show`` training rows in the run's order; ``text`` and ``target`` are null
without a tokenizer). Exit 2 with the ``DataError`` on stderr when the data does not fit the
schedule or the model.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
from pathlib import Path
from typing import Any

from launch.data.cache import IGNORE, RECORDS, DataError, cached, load_tokenizer, prepare, read_stats
from launch.contract.data import DataPart
from launch.data.records import where
from shard_tools.tokenizer import TOKENIZER_FILES


def inspect(req: dict[str, Any]) -> dict[str, Any]:
    """Prepares and checks the data of one request (the module docstring's object)."""
    from launch.data.examples import SampleOrder, load_examples, training_rows

    data = DataPart.model_validate(req["data"])
    tokenizer, root = req.get("tokenizer"), Path(req["cache_root"])
    reuse = tuple(Path(p) for p in req.get("reuse", ()))
    vocab = req.get("vocab_size")
    # Prepared already (a resume, plan after run): the tokenizer loaded then, and importing
    # transformers to load it again took 3 s of the 3.4 s of each resume's data step on 2 cores.
    cache = cached(data, tokenizer, root, reuse)
    if cache is None:
        for source in (*data.sources, *data.validation):
            if source.format != "tokens":
                _check_tokenizer(source, tokenizer)
        cache = prepare(data, tokenizer, root, reuse, vocab_size=vocab)
    check(data, cache, vocab)
    out: dict[str, Any] = {"stats": read_stats(cache), "rows": []}
    if req.get("show"):
        examples = load_examples(cache)
        order = SampleOrder(len(examples), data.seed, data.shuffle)
        tok = _decoder(data, tokenizer)
        for ids, labels in training_rows(examples, order, req["show"]):
            targets = [t for t in labels[1:] if t != IGNORE]
            out["rows"].append({"text": tok.decode(ids) if tok else None,
                                "target": tok.decode(targets) if tok else None,
                                "input_ids": ids, "target_ids": targets})
    return out


def check(data: DataPart, cache: Path, vocab_size: int | None) -> None:
    """Records that the model can take and learn from: some target tokens (``no_targets``), every
    token id and target below its vocabulary size (the first offending record of a file named).
    ``seq_len`` against the model's positions is the schedule's check (``orchestrator.validate``),
    made before this runs."""
    import numpy as np
    from safetensors.numpy import load_file

    no_targets(data, read_stats(cache))
    if not vocab_size:
        return
    max_ids = load_file(str(cache / RECORDS))
    for i, source in enumerate((*data.sources, *data.validation)):
        bad = max_ids[f"max_id.{i}"] >= vocab_size
        if bad.any():
            record = int(np.argmax(bad))
            path = Path(source.path).resolve()
            raise DataError(f"token id {int(max_ids[f'max_id.{i}'][record])} is not below the model's vocab_size "
                            f"{vocab_size} (config.json)", str(path), **where(path, record))


def no_targets(data: DataPart, stats: dict[str, Any]) -> None:
    """DataError where no token carries loss: a run would train on nothing (loss 0.0) and end well.
    The training rows as a whole, then each source (one that adds nothing is a mistake too), then
    the held-out rows (an eval_loss of nothing)."""
    train, sources = stats["train"], stats["sources"]
    if not train["target_tokens"]:
        key = f"{sources[0]['key']}.path" if len(sources) == 1 else "data.sources"
        raise DataError(f"{key}: no target tokens, nothing to train on: {_why(data, sources[0], train)}",
                        ", ".join(s["path"] for s in sources))
    for s in sources:
        if not s["target_tokens"]:
            raise DataError(f"{s['key']}.path: no target tokens, nothing to train on: {_why(data, s, s)}", s["path"])
    if stats["validation"] is not None and not stats["validation"]["target_tokens"]:
        key = "data.validation_path" if data.validation else "data.validation_split"
        raise DataError(f"{key}: no target tokens in the held-out rows, nothing to evaluate")


def _why(data: DataPart, source: dict[str, Any], counts: dict[str, Any]) -> str:
    """Why ``source``'s rows carry no loss, by its format; ``counts``: the examples and truncated of those rows."""
    return {"tokens": f"every label is -100 or a row's first (data.seq_len = {data.seq_len}), which nothing predicts",
            "text": f"every row is one token long (data.seq_len = {data.seq_len})"}.get(
        source["format"], f"no assistant turn is rendered within data.seq_len = {data.seq_len} (a template that "
                          f"renders none, or prompts that fill every row: {counts['truncated']} of "
                          f"{counts['examples']} examples cut)")


def _check_tokenizer(source, tokenizer: str | None) -> None:
    """A tokenizer that does not load is bad input (exit 2), not a fault of the preparation."""
    try:
        load_tokenizer(source, tokenizer)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for broken files
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"model.tokenizer: cannot load a tokenizer from {tokenizer}: {type(e).__name__}: {first}") \
            from None


def _decoder(data: DataPart, tokenizer: str | None):
    """The tokenizer for showing rows; tokens data shows ids alone where there is none."""
    if tokenizer and any((Path(tokenizer) / f).is_file() for f in TOKENIZER_FILES):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(tokenizer)
    return None


class _WithoutTorch(importlib.machinery.PathFinder):
    """The path finder, finding no torch: the tool tokenizes with ``tokenizers`` and renders with
    jinja, and transformers, which imports torch wherever it is installed, then runs as it does in
    a tokenizers-only install. ``AutoTokenizer.from_pretrained`` took 4.0 s of CPU with torch and
    1.7 s without on 2 cores (it is the most of ``orchestrator data``)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] == "torch":
            return None
        return super().find_spec(fullname, path, target)


def without_torch() -> None:
    """From now on in this process (and its forked ``datasets.map`` workers) torch is not installed."""
    sys.meta_path[:] = [_WithoutTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found", said on stderr


def main() -> None:
    from launch.procs import set_parent_death_signal

    without_torch()

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
