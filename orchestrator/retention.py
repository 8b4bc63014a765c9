"""Retention: the newest ``checkpoint.keep_last`` checkpoints stay, with every older one whose layer
files they still read; the rest go."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from shard_tools.files import TMP_PREFIX
from shard_tools.errors import CheckpointError
from shard_tools.manifest import list_checkpoints, needed_by, verify_checkpoint


def retain(run_dir: Path, keep_last: int, protect: set[Path], event: Callable[..., None]) -> None:
    """Keeps the newest ``keep_last`` checkpoints and everything they still need; removes the rest.

    ``protect``: checkpoints a pre-warmed successor may still be reading.
    """
    valid = [c for c in list_checkpoints(run_dir) if not verify_checkpoint(c, checksums=False)]
    kept = valid[-keep_last:]
    try:
        needed = needed_by(run_dir, kept + sorted(protect))
    except CheckpointError as e:  # a damaged older checkpoint: keep everything rather than guess
        event("retention_skipped", reason=str(e))
        return
    for ckpt in valid:
        if ckpt not in needed:
            trash = ckpt.with_name(f"{TMP_PREFIX}removing-{ckpt.name}")
            os.replace(ckpt, trash)
            shutil.rmtree(trash)
            event("checkpoint_removed", path=str(ckpt))
