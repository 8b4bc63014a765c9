"""The run journal's writer: one JSON object a line, appended and fsynced (its reader and replay:
``shard_tools.history``), and the tail of a JSON-lines file as it grows."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from shard_tools.history import JOURNAL


# Events that only tell what happened (no replay reads them), written during a switch: an fsync
# there waits behind the committer's multi-GB fsync of a checkpoint (one journal commit of the file
# system holds both), which at 7B on an H200 put 0.4-0.7 s into switches (benchmarks/_switch_gaps.py).
UNSYNCED = frozenset({"preparing_paused", "preparing_resumed", "prewarm_started"})


class Journal:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / JOURNAL

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, **fields}
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
            if event not in UNSYNCED:
                os.fsync(fd)
        finally:
            os.close(fd)
        return record


class JsonlTail:
    """What is appended to a JSON-lines file from now on, read incrementally: whole lines only (a
    line still being written waits for the next read), lines that are not JSON objects skipped."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        out = []
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                out.append(record)
        return out
