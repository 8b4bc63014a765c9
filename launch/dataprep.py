"""Prepare once: read a data file with Hugging Face ``datasets``, render and tokenize it in
parallel, pack or pad it into ``seq_len`` rows, and write the rows to a cache every process maps.

    cache = prepare(data, tokenizer_dir, run_dir / "data-cache")   # idempotent, safe to race
    read_stats(cache)                                              # {"examples": ..., "rows": ...}

A cache entry ``<cache_root>/<key>/`` holds ``rows.safetensors`` (int32 ``input_ids`` and
``labels`` [rows, seq_len], int32 ``lengths`` [rows] (tokens before the padding) and ``targets``
[rows] (tokens that carry loss: ``labels[1:] != -100``)) and ``stats.json``. The key is the data
file's identity (resolved path, size, mtime_ns: no full-file hash), the tokenizer files' digest and
every format option, so an edited file or another option is another entry. Labels are aligned as
in Hugging Face: the model shifts them, -100 carries no loss.

Formats (``data.format``): ``tokens`` (``input_ids`` rows of any length, optional ``labels``),
``text`` (a ``.txt`` file, documents separated by blank lines, or records with a text field; loss
on every token; an EOS closes each document), ``instruction`` (Alpaca records; loss on the response
and its EOS), ``chat`` (``messages`` [{role, content}] or ShareGPT ``conversations`` [{from,
value}]; loss on each assistant turn and its end-of-turn tokens). A record that does not fit its
format is a ``DataError`` naming the file and line (jsonl, json lines, csv) or record index.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from launch import faults
from launch.contract.spec import DataPart, is_template_path
from launch.rows import IGNORE, pack, pad, ragged
from launch.records import DataError, find_bad_record, json_lines, nesting_fault, token_fault, where
from launch.template import BudgetExceeded, Renderer, TemplateFault
from shard_tools.tokenizer import TOKENIZER_FILES

CACHE_VERSION = 1
"""Part of every cache key: bump it when the rows prepared from the same input change."""
ROWS, STATS = "rows.safetensors", "stats.json"
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")
ALPACA = ("Below is an instruction that describes a task{context}. Write a response that appropriately completes "
          "the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
PARALLEL_FROM = 20_000
"""Records from which tokenizing runs in several processes (below it, starting them costs more)."""


class StoppedAt(Exception):
    """Raised out of ``datasets.map`` (its workers too): (message, record index); picklable."""


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
    for other in reuse:
        if _made(Path(other) / key):
            return Path(other) / key
    out = Path(cache_root) / key
    if _made(out):
        return out
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
    """``stats.json`` of a cache entry: examples (records read), tokens (of the examples, before
    packing or truncation), target_tokens (tokens that carry loss, in the rows), truncated
    (examples cut to seq_len, pad mode), dropped_tokens (pack mode: the last partial row),
    rows, seq_len, padding_tokens, rows_without_targets, format, pack, source."""
    return json.loads((Path(cache_dir) / STATS).read_text())


def cache_key(data: DataPart, tokenizer: str | None) -> str:
    path = Path(data.path).resolve()
    h = hashlib.sha256(json.dumps({"v": CACHE_VERSION, "path": str(path), "file": _identity(path),
                                   "format": data.format, "seq_len": data.seq_len, "pack": data.packs,
                                   "train_on_prompt": data.train_on_prompt, "fields": data.fields,
                                   "template": _template_text(data) if data.format != "tokens" else None},
                                  sort_keys=True).encode())
    if data.format != "tokens" and tokenizer:
        for name in TOKENIZER_FILES:
            f = Path(tokenizer) / name
            if f.is_file():
                h.update(name.encode() + f.read_bytes())
    return h.hexdigest()[:20]


def _identity(path: Path) -> list:
    if path.is_dir():
        return sorted([str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns]
                      for f in path.rglob("*") if f.is_file())
    try:
        st = path.stat()
    except OSError:
        raise DataError("no such data file", str(path)) from None
    return [st.st_size, st.st_mtime_ns]


def _template_text(data: DataPart) -> str | None:
    t = data.chat_template
    if t is None or not is_template_path(t):
        return t
    try:
        return Path(t).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.chat_template: cannot read it: {e}", t) from None


# -- building an entry -------------------------------------------------------------------------
def _build(data: DataPart, tokenizer: str | None, out: Path, vocab_size: int | None = None) -> None:
    from safetensors.numpy import save_file

    path = Path(data.path).resolve()
    tok = load_tokenizer(data, tokenizer) if data.format != "tokens" else None
    ds = read_records(data, path, out / "hf-cache")
    if len(ds) == 0:
        raise DataError("no examples", str(path))
    enc = _encode_all(data, tok, vocab_size, ds, path)
    ids, lengths = ragged(enc, "input_ids")
    labels, _ = ragged(enc, "labels")
    stats: dict[str, Any] = {"format": data.format, "pack": data.packs, "seq_len": data.seq_len,
                             "source": str(path), "examples": len(ds), "tokens": int(lengths.sum())}
    input_ids, row_labels, row_lengths = (pack if data.packs else pad)(ids, labels, lengths, data.seq_len, stats)
    if len(input_ids) == 0:
        raise DataError(f"{stats['tokens']} tokens, fewer than one example of data.seq_len = {data.seq_len}",
                        str(path))
    targets = (row_labels[:, 1:] != IGNORE).sum(axis=1).astype(np.int32)
    stats.update(rows=len(input_ids), target_tokens=int(targets.sum()),
                 padding_tokens=int(data.seq_len * len(input_ids) - row_lengths.sum()),
                 rows_without_targets=int((targets == 0).sum()))
    shutil.rmtree(out / "hf-cache", ignore_errors=True)
    save_file({"input_ids": input_ids, "labels": row_labels, "lengths": row_lengths, "targets": targets},
              str(out / ROWS))
    _as_umask_allows(out / ROWS)
    (out / STATS).write_text(json.dumps(stats, indent=1) + "\n")


def _encode_all(data: DataPart, tok, vocab_size: int | None, ds, path: Path):
    """Every record rendered and tokenized (``datasets.map``, in worker processes for many); the
    first record at fault raises ``DataError`` naming its line."""
    try:
        encode = _Encoder(data, tok, vocab_size)
    except TemplateFault as e:
        raise DataError(str(e)) from None
    num_proc = min(8, os.cpu_count() or 1) if len(ds) >= PARALLEL_FROM else None
    try:
        enc = ds.map(encode, batched=True, batch_size=256, with_indices=True, num_proc=num_proc,
                     remove_columns=ds.column_names, desc=None)
    except UnicodeDecodeError:
        # pyarrow's JSON reader keeps invalid bytes; they fail when the strings are read here.
        find_bad_record(path, _Encoder(data, None).check)
        raise DataError("not UTF-8", str(path)) from None
    except StoppedAt as e:  # the template's budget: one record named, the rest not rendered
        raise DataError(e.args[0], str(path), **where(path, e.args[1])) from None
    bad = [i for i, e in enumerate(enc["error"]) if e]
    if bad:
        # JSON read as columns: one float id makes every record's ids floats; the lines tell.
        find_bad_record(path, encode.check)
        raise DataError(enc[bad[0]]["error"], str(path), **where(path, bad[0]))
    return enc


def _as_umask_allows(path: Path) -> None:
    """safetensors creates its files 0600 whatever the umask; the run's umask decides (run.group_readable)."""
    mask = os.umask(0o077)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


# -- reading records ---------------------------------------------------------------------------
def read_records(data: DataPart, path: Path, hf_cache: Path):
    """The file as a ``datasets.Dataset`` of records (a ``.txt`` file: one record a document)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise DataError(f"expected a folder written by datasets.save_to_disk: {e}", str(path)) from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"a DatasetDict without a train split (splits: {', '.join(ds)})", str(path))
            ds = ds["train"]
        return ds
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(f"expected a {', '.join(SUFFIXES)} file or a datasets.save_to_disk folder", str(path))
    if suffix == ".txt":
        if data.format != "text":
            raise DataError(f'a .txt file is text; data.format = "{data.format}" needs records', str(path))
        return datasets.Dataset.from_dict({"text": _documents(path)})
    if suffix == ".arrow":
        try:
            return datasets.Dataset.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds; the file is to blame
            raise DataError(f"not an Arrow stream file: {e}", str(path)) from None
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}[suffix]
    if builder == "json" and json_lines(path):
        nesting_fault(path)
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=str(hf_cache))
    except Exception as e:  # noqa: BLE001 - datasets wraps parse errors in several types
        find_bad_record(path, _Encoder(data, None).check)
        raise DataError(f"cannot read it as {suffix[1:]}: {_cause(e)}", str(path)) from None


def _cause(e: BaseException) -> str:
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {e}"[:300]


def _documents(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8 text (byte {e.start})", str(path)) from None
    return [d.strip() for d in text.split("\n\n") if d.strip()]


# -- rendering and tokenizing ------------------------------------------------------------------
def load_tokenizer(data: DataPart, tokenizer: str | None):
    """The fast tokenizer of ``tokenizer`` (with ``data.chat_template`` set over its own)."""
    import transformers

    if not tokenizer or not any((Path(tokenizer) / f).is_file() for f in TOKENIZER_FILES):
        raise DataError(f'data.format = "{data.format}" needs a tokenizer: model.tokenizer (default model.path) '
                        f"{tokenizer or '(none)'} has no tokenizer files")
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=False)
    if not tok.is_fast:
        raise DataError("expected a fast tokenizer (tokenizer.json); this one is slow", tokenizer)
    template = _template_text(data)
    if template is not None:
        tok.chat_template = template
    if data.format == "chat" and not tok.chat_template:
        raise DataError("data.format = \"chat\" needs a chat template: the tokenizer has none; set data.chat_template",
                        tokenizer)
    return tok


class _Encoder:
    """``datasets.map`` function: a batch of records -> input_ids, labels and an error per record
    (a string, empty when the record is fine: an exception inside a worker would lose its index)."""

    def __init__(self, data: DataPart, tok, vocab_size: int | None = None):
        self.data, self.tok, self.f, self.vocab_size = data, tok, data.field, vocab_size
        self.eos = [] if tok is None or tok.eos_token_id is None else [tok.eos_token_id]
        key = "data.chat_template" if data.chat_template is not None else "the tokenizer's chat_template"
        self.template = (Renderer(tok.get_chat_template(), tok.special_tokens_map, key)
                         if tok is not None and tok.chat_template else None)

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        faults.point("data.batch")
        out: dict[str, list] = {"input_ids": [], "labels": [], "error": []}
        for i in range(len(indices)):
            rec = {k: v[i] for k, v in batch.items()}
            err, ids, labels = self.check(rec), [], []
            if not err:
                try:
                    ids, labels = self.encode(rec)
                except BudgetExceeded as e:
                    raise StoppedAt(str(e), indices[i]) from None
                except (DataError, TemplateFault) as e:
                    err = str(e)
            if not err and not ids:
                err = "no tokens"
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["error"].append(err)
        return out

    def check(self, rec: Any) -> str:
        """What is wrong with one record for the format, or ""."""
        if not isinstance(rec, dict):
            return f"expected a record (an object), got {type(rec).__name__}"
        fmt, f = self.data.format, self.f
        if fmt == "tokens":
            return token_fault(rec.get(f("input_ids")), rec.get(f("labels")), f, self.vocab_size)
        if fmt == "text":
            return "" if isinstance(rec.get(f("text")), str) else f'expected a "{f("text")}" field holding a string'
        if fmt == "instruction":
            for name, required in (("instruction", True), ("input", False), ("output", True)):
                v = rec.get(f(name))
                if not isinstance(v, str) and (required or v is not None):
                    return f'expected a "{f(name)}" field holding a string' + ("" if required else " (or none)")
            return ""
        turns = self.messages(rec)
        return turns if isinstance(turns, str) else ""

    def messages(self, rec: dict) -> list[dict] | str:
        """A chat record as [{"role", "content"}], or what is wrong with it."""
        f = self.f
        if rec.get(f("messages")) is not None:
            turns, role, content, roles = rec[f("messages")], "role", "content", None
        elif rec.get(f("conversations")) is not None:
            turns, role, content, roles = rec[f("conversations")], "from", "value", SHAREGPT_ROLES
        else:
            return f'expected "{f("messages")}" [{{"role", "content"}}] or "{f("conversations")}" [{{"from", "value"}}]'
        if not isinstance(turns, list) or not turns:
            return "expected a non-empty list of turns"
        out = []
        for j, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get(role), str) or not isinstance(t.get(content), str):
                return f'turn {j}: expected {{"{role}": string, "{content}": string}}'
            r = t[role] if roles is None else roles.get(t[role])
            if r not in ("system", "user", "assistant"):
                known = "system, user, assistant" if roles is None else ", ".join(SHAREGPT_ROLES)
                return f'turn {j}: {role} "{t[role]}" is not one of {known}'
            out.append({"role": r, "content": t[content]})
        if not any(t["role"] == "assistant" for t in out):
            return "no assistant turn: nothing to learn"
        return out

    def encode(self, rec: dict) -> tuple[list[int], list[int]]:
        fmt, f, tok = self.data.format, self.f, self.tok
        if fmt == "tokens":
            ids = list(rec[f("input_ids")])
            labels = rec.get(f("labels"))
            return ids, list(ids if labels is None else labels)
        if fmt == "text":
            ids = tok(rec[f("text")], add_special_tokens=False)["input_ids"] + self.eos
            return ids, list(ids)
        if fmt == "instruction":
            instruction, context, output = rec[f("instruction")], rec.get(f("input")) or "", rec[f("output")]
            if tok.chat_template:
                user = instruction + ("\n\n" + context if context else "")
                return self.chat([{"role": "user", "content": user}, {"role": "assistant", "content": output}])
            prompt = ALPACA.format(context=", paired with an input that provides further context" if context else "",
                                   instruction=instruction, input=f"### Input:\n{context}\n\n" if context else "")
            # The tokenizer's own special tokens (a BOS where it adds one), as a plain prompt gets them.
            p = tok(prompt)["input_ids"]
            r = tok(output, add_special_tokens=False)["input_ids"] + self.eos
            return p + r, (p if self.data.train_on_prompt else [IGNORE] * len(p)) + r
        return self.chat(self.messages(rec))

    def chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Rendered with the chat template; the targets are the characters each assistant turn adds
        to the rendering (its content and end-of-turn tokens), found by rendering prefixes."""
        tok, render = self.tok, self.template.render
        text = render(messages)
        spans = []
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render(messages[:j], add_generation_prompt=True) if j else ""
            through = render(messages[: j + 1])
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise DataError("the chat template does not render a conversation's prefixes as prefixes of the "
                                "whole; it cannot mark assistant turns")
            spans.append((len(before), len(through)))
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if self.data.train_on_prompt:
            return ids, list(ids)
        labels = [t if any(a <= s < b for a, b in spans) else IGNORE for t, (s, _) in zip(ids, enc["offset_mapping"])]
        return ids, labels
