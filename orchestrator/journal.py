"""The run journal's writer: one JSON object a line, appended and fsynced (its reader and replay:
``shard_tools.history``), and the tail of a JSON-lines file as it grows."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from launch.contract import faults
from orchestrator.errors import ScheduleError
from shard_tools.files import describe, open_append, open_regular
from shard_tools.history import JOURNAL


# Events that only tell what happened (no replay reads them), written during a switch: an fsync
# there waits behind the committer's multi-GB fsync of a checkpoint (one journal commit of the file
# system holds both), which at 7B on an H200 put 0.4-0.7 s into switches (benchmarks/_switch_gaps.py).
UNSYNCED = frozenset({"preparing_paused", "preparing_not_paused", "preparing_resumed", "prewarm_started",
                      "final_model_prewarm"})


class Journal:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / JOURNAL

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, **fields}
        fd = open_append(self.path)  # never through a link, never blocked on a FIFO
        try:
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
            if event not in UNSYNCED:
                faults.point("journal.fsync", event=event, phase=fields.get("phase"))
                os.fsync(fd)
        finally:
            os.close(fd)
        return record


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
