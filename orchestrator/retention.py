"""Retention: the newest ``checkpoint.keep_last`` checkpoints stay whole; of every older one whose
layers file they still read only that file stays; the rest go (``Checkpoints.purge``), each journaled.

A checkpoint a stop named to the user ("kept: the checkpoint at step 25") stays whole too, until a
later stop names another or the run ends: the user may export it meanwhile (seen: retention
removed it after the resume, and the export said "no such file or directory").
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from shard_tools.errors import CheckpointError
from shard_tools.history import read_journal
from shard_tools.store import Checkpoints


def retain(store: Checkpoints, keep_last: int, protect: set[Path], event: Callable[..., None]) -> None:
    """Keeps the newest ``keep_last`` checkpoints and everything they still need; removes the rest.

    ``protect``: checkpoints a pre-warmed successor may still be reading, or a stop named.
    """
    try:
        for done in store.purge(keep_last, protect):
            event("checkpoint_removed" if done.removed else "checkpoint_layers_kept", path=str(done.path))
    except CheckpointError as e:  # a damaged older checkpoint: keep everything rather than guess
        event("retention_skipped", reason=str(e))


def named_at_stop(store: Checkpoints) -> set[Path]:
    """The checkpoint the run's last stop named to the user (a ``preempted`` event with a
    ``checkpoint``, at its ``step``), where the run has not ended since and it is still there (not
    set aside by --resume-from); else none."""
    for e in reversed(read_journal(store.run_dir)):
        if e.get("event") == "run_done":
            return set()
        if e.get("event") == "preempted" and e.get("checkpoint") and isinstance(e.get("step"), int):
            named = store.at(e["step"])
            return {named} if named.is_dir() else set()
    return set()
