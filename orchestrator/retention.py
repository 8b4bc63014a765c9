"""Retention: the newest ``checkpoint.keep_last`` checkpoints stay whole; of every older one whose
layers file they still read only that file stays; the rest go (``Checkpoints.purge``), each journaled."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from shard_tools.errors import CheckpointError
from shard_tools.store import Checkpoints


def retain(store: Checkpoints, keep_last: int, protect: set[Path], event: Callable[..., None]) -> None:
    """Keeps the newest ``keep_last`` checkpoints and everything they still need; removes the rest.

    ``protect``: checkpoints a pre-warmed successor may still be reading.
    """
    try:
        for done in store.purge(keep_last, protect):
            event("checkpoint_removed" if done.removed else "checkpoint_layers_kept", path=str(done.path))
    except CheckpointError as e:  # a damaged older checkpoint: keep everything rather than guess
        event("retention_skipped", reason=str(e))
