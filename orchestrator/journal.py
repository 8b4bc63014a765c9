"""The run journal: one JSON object a line, appended and fsynced, read back tolerantly."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from orchestrator.errors import ScheduleError
from shard_tools.files import describe, open_append, open_regular

JOURNAL = "journal.jsonl"


class Journal:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / JOURNAL

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, **fields}
        fd = open_append(self.path)  # never through a link, never blocked on a FIFO
        try:
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return record


# The fields that readers (status, report, the runner) take from events, with their types; an
# event holding one of another type is not one this code wrote, and is skipped like a torn line.
FIELD_TYPES: dict[str, type] = {"phase": int, "start_step": int, "end_step": int, "step": int, "layers": list,
                                "nproc": int, "records": dict, "reason": str}
REQUIRED = {"phase_started": ("phase", "start_step", "end_step", "layers"), "phase_done": ("phase", "step", "layers"),
            "resumed": ("step",), "preempted": ("step",), "phase_failed": ("phase",)}


def is_event(record: Any) -> bool:
    """A JSON object as ``Journal.write`` makes them: an event name, a time, fields of the types readers expect."""
    if not (isinstance(record, dict) and isinstance(record.get("event"), str) and _number(record.get("time"))):
        return False
    if any(key not in record for key in REQUIRED.get(record["event"], ())):
        return False
    for key, kind in FIELD_TYPES.items():
        value = record.get(key)
        if value is None and key not in REQUIRED.get(record["event"], ()):
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            return False
        if kind is list and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return False
    return True


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def read_journal(run_dir: Path) -> list[dict[str, Any]]:
    """Every event; what is not one (a torn last line from a writer killed mid-write, a line edited
    or damaged by hand) is skipped."""
    with open_run_file(Path(run_dir) / JOURNAL, "the run's journal") as f:
        data = f.read() if f is not None else b""
    events = []
    for line in data.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if is_event(record):
            events.append(record)
    return events


@contextmanager
def open_run_file(path: Path, what: str) -> Iterator[BinaryIO | None]:
    """A run's file for reading (links followed), or None where it is missing; a FIFO, a device, a
    folder or a link loop is ScheduleError naming it, never a block."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        yield None
        return
    except OSError as e:
        raise ScheduleError(f"{path}: {describe(e)}; expected {what}") from None
    with os.fdopen(fd, "rb") as f:
        yield f


class JsonlTail:
    """What is appended to a JSON-lines file from now on, read incrementally: whole lines only (a
    line still being written waits for the next read), lines that are not JSON objects skipped."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def new(self) -> list[dict[str, Any]]:
        with open_run_file(self.path, "a file of JSON lines") as f:
            if f is None:
                return []
            f.seek(self.offset)
            chunk = f.read()
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        out = []
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                continue
            if isinstance(record, dict):
                out.append(record)
        return out
