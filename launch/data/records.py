"""A data file's records: read with Hugging Face ``datasets``, and the record to blame named by its
file and line when one does not fit.

    ds = read_records(source, path, hf_cache, check)   # a datasets.Dataset, one row a record
    find_bad_record(path, check)                    # after datasets failed: raises DataError at the record
    where(path, index)                              # {"line": 12} (json lines, csv) or {"record": index}
    token_fault(ids, labels, f, vocab_size)         # what is wrong with a tokens record's ids, or ""

A ``tokens`` record's ids are checked against the model's vocabulary (else the cache's int32: nothing
is narrowed); JSON nested deeper than ``MAX_DEPTH`` is refused before pyarrow's C reader recurses.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launch.contract.data import SourcePart
from launch.data.rows import IGNORE

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")
ID_LIMIT = 2 ** 31
"""Token ids and labels are int32 in the cache; one at or past this is refused, never narrowed."""
MAX_DEPTH = 100
"""JSON records nested deeper are refused (``nesting_fault``)."""


class DataError(ValueError):
    """The data does not fit the schedule. ``file`` and ``line`` (1-based, for jsonl, json lines
    and csv) or ``record`` (0-based index, other file types) say where, when one record is to blame;
    the message names them too."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None, record: int | None = None):
        where = f"{file}:{line}: " if file and line else f"{file}: record {record}: " if file and record is not None \
            else f"{file}: " if file else ""
        super().__init__(where + message)
        self.file, self.line, self.record = file, line, record


def read_records(source: SourcePart, path: Path, hf_cache: Path, check: Callable[[Any], str]):
    """The file as a ``datasets.Dataset`` of records (a ``.txt`` file: one record a document);
    ``check`` (``find_bad_record``'s) names the record to blame where the file does not parse."""
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
        if source.format != "text":
            raise DataError(f'a .txt file is text; format = "{source.format}" needs records', str(path))
        return datasets.Dataset.from_dict({"text": _documents(path)})
    if suffix == ".arrow":
        try:
            return datasets.Dataset.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds; the file is to blame
            raise DataError(f"not an Arrow stream file: {e}", str(path)) from None
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}[suffix]
    if builder == "json" and _json_lines(path):
        nesting_fault(path)
    kwargs = {"features": _csv_as_text(path)} if builder == "csv" else {}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=str(hf_cache), **kwargs)
    except Exception as e:  # noqa: BLE001 - datasets wraps parse errors in several types
        find_bad_record(path, check)
        raise DataError(f"cannot read it as {suffix[1:]}: {_cause(e)}", str(path)) from None


def _csv_as_text(path: Path):
    """Every column of a CSV file as text (an empty cell: none): an instruction whose output is "3"
    is text, which type inference made a number and the format refused; None where the header
    cannot be read (the load names why)."""
    import datasets

    try:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    if not header or len(set(header)) != len(header):
        return None
    return datasets.Features({name: datasets.Value("string") for name in header})


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


def _json_lines(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return not head.startswith(b"[")


def find_bad_record(path: Path, check: Callable[[Any], str]) -> None:
    """After ``datasets`` failed on a file: the first record to blame, as a ``DataError``; each
    JSON record is parsed alone and checked by ``check`` (a reason, or "" for a record that fits)."""
    try:
        raw = path.read_bytes().decode("utf-8") if path.suffix.lower() in (".jsonl", ".json", ".csv") else None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DataError(f"not UTF-8 (byte {e.start})", str(path), line=line) from None
    if raw is None or path.suffix.lower() == ".csv":
        return
    if not _json_lines(path):
        try:
            records = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"not valid JSON: {e.msg}", str(path), line=e.lineno) from None
        except RecursionError:
            raise DataError(f"a record nested more than {MAX_DEPTH} deep", str(path)) from None
        for i, rec in enumerate(records if isinstance(records, list) else []):
            if (err := check(rec)):
                raise DataError(err, str(path), record=i)
        return
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"not valid JSON: {e.msg}", str(path), line=lineno) from None
        except RecursionError:
            raise DataError(f"a record nested more than {MAX_DEPTH} deep", str(path), line=lineno) from None
        if (err := check(rec)):
            raise DataError(err, str(path), line=lineno)


def where(path: Path, index: int) -> dict[str, int]:
    """Record ``index`` of a file: its 1-based line in json lines and csv, else the index itself."""
    suffix = path.suffix.lower() if path.is_file() else ""
    if suffix in (".jsonl", ".json") and _json_lines(path):
        with open(path, "rb") as f:
            seen = -1
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    seen += 1
                    if seen == index:
                        return {"line": lineno}
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            next(reader, None)
            start = reader.line_num + 1
            for i, _ in enumerate(reader):
                if i == index:
                    return {"line": start}
                start = reader.line_num + 1
    return {"record": index}


def token_fault(ids: Any, labels: Any, f: Callable[[str], str], vocab_size: int | None) -> str:
    """What is wrong with a ``tokens`` record's ids and labels (``f`` names their fields), or "".
    Every id must be below ``vocab_size`` (else below ``ID_LIMIT``): nothing is narrowed."""
    if not ints(ids) or not ids:
        return f"expected {f('input_ids')}, a non-empty list of token ids"
    if labels is not None and (not ints(labels) or len(labels) != len(ids)):
        return f"{f('labels')}: expected a list of {len(ids)} token ids or -100, aligned with {f('input_ids')}"
    limit = vocab_size or ID_LIMIT
    for name, values, ignore in ((f("input_ids"), ids, False), (f("labels"), labels or [], True)):
        bad = next((t for t in values if not (0 <= t < limit or (ignore and t == IGNORE))), None)
        if bad is None:
            continue
        if bad < 0:
            return f"{name}: expected token ids >= 0{' or -100' if ignore else ''}, got {bad}"
        return (f"{name}: token id {bad} is not below the model's vocab_size {vocab_size} (config.json)"
                if vocab_size else f"{name}: token id {bad} does not fit the data cache's 32-bit ids")
    return ""


def nesting_fault(path: Path) -> None:
    """``DataError`` naming the first line of a JSON-lines file nested more than ``MAX_DEPTH`` deep:
    pyarrow's reader recurses in C and crashes the process on a record some thousands deep. A line
    with fewer brackets cannot be nested deeper, so only the others are parsed here."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
                continue
            try:
                todo, deep = [(json.loads(line), 1)], False
                while todo and not deep:
                    value, depth = todo.pop()
                    deep = depth > MAX_DEPTH
                    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
                    todo.extend((v, depth + 1) for v in items)
            except RecursionError:
                deep = True
            except ValueError:
                continue  # not JSON: the reader names it
            if deep:
                raise DataError(f"a record nested more than {MAX_DEPTH} deep", str(path), line=lineno)


def ints(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
