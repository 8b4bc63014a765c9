"""``shard-tools verify``: is every file of a checkpoint, or of every checkpoint of a run, present with
the size and sha256 its manifest records?

    shard-tools verify runs/tiny                              # exit 1 naming each faulty file
    shard-tools verify runs/tiny/checkpoints/step-00000030

No torch here: checksums are over the files' bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shard_tools.errors import CheckpointError, InputError
from shard_tools.manifest import CHECKPOINTS, MANIFEST, STEP_DIR_SHAPE, Manifest, path_kind, read_manifest, step_of, verify_checkpoint
from shard_tools.store import Checkpoints, gone_since_listed


@dataclass
class Report:
    checkpoints: list[Path]
    faults: list[str]
    files: int
    bytes: int
    removed: list[Path] = field(default_factory=list)
    """Checkpoints of a run in training that its retention removed while they were read."""
    writing: list[Path] = field(default_factory=list)
    """Temporaries of processes running on this machine: checkpoints being written or removed."""

    def in_training(self) -> str:
        """What a run in training did meanwhile, for the summary line; empty where nothing."""
        said = [f"{len(self.removed)} removed by retention while read"] if self.removed else []
        said += [f"{len(self.writing)} being written or removed ({', '.join(p.name for p in self.writing)})"] \
            if self.writing else []
        return "".join(f"; {s}" for s in said)


def verify_path(path: Path) -> Report:
    """Every checkpoint of a run, or the one named. A run may be training meanwhile: a checkpoint its
    retention removes, or makes layers-only, while it is read is not a fault (read again where its
    manifest was replaced), nor is a temporary of a process running here."""
    path = Path(path)
    is_run = path_kind(path) == "run"
    store = Checkpoints(path)
    checkpoints = store.all() if is_run else [path]
    report = Report([], [], 0, 0)
    for ckpt in checkpoints:
        before = _identity(ckpt / MANIFEST)
        faults = verify_checkpoint(ckpt)
        if faults and is_run and gone_since_listed(ckpt):
            report.removed.append(ckpt)
            continue
        if faults and is_run and _identity(ckpt / MANIFEST) != before:
            faults = verify_checkpoint(ckpt)
        if not faults and step_of(ckpt) is not None:
            lost = (store if is_run else Checkpoints(ckpt.absolute().parent.parent)).lost_source(ckpt)
            faults = [str(lost)] if lost else []
            if faults and is_run and (gone_since_listed(ckpt) or _identity(ckpt / MANIFEST) != before):
                faults = []  # retention made it layers-only (or removed it) meanwhile: what it named may go
        report.checkpoints.append(ckpt)
        report.faults += faults
        if not faults:
            sizes = [e.size for e in read_manifest(ckpt).files.values()]
            report.files += len(sizes)
            report.bytes += sum(sizes)
    if is_run:
        report.writing, left = store.being_written()
        report.faults += [f"{p}: stray temporary left by an interrupted writer (the orchestrator removes it on its "
                          f"next run)" for p in left]
    return report


def _identity(path: Path) -> tuple[int, int] | None:
    """The file at ``path`` (inode, mtime): a manifest replaced by an atomic rename is another."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def trusted_checkpoint(path: Path, warn: Callable[[str], None] | None = None) -> tuple[Path, Path, Manifest]:
    """(run dir, checkpoint, manifest) whose composed weights can be trusted.

    ``path`` is a checkpoint, or a run (its newest whole checkpoint: ``warn`` is told of every newer
    one skipped as damaged, so that an older one is never used unsaid). The checkpoint and every
    earlier one its layers compose from must verify with checksums: loading alone would miss a
    flipped byte in tensor data, and skipping a damaged source would silently compose an older layer.
    """
    path = Path(path)
    if path_kind(path) == "run":
        run_dir = path
        ckpt, manifest, skipped = Checkpoints(run_dir).newest_whole()
        if ckpt is None:
            raise CheckpointError(f"{run_dir}: no whole checkpoint" + "".join(f"\n  {f}" for f in skipped))
        if skipped and warn is not None:
            warn(f"{run_dir}: using {ckpt.name}, not the newest: a newer checkpoint is damaged ("
                 + "; ".join(skipped) + ")")
    else:
        if step_of(path) is None or path.absolute().parent.name != CHECKPOINTS:
            raise InputError(f"{path}: not inside a run's {CHECKPOINTS}/ as {STEP_DIR_SHAPE}; a checkpoint's "
                             f"weights compose from its run's earlier checkpoints")
        ckpt = path.absolute()
        run_dir = ckpt.parent.parent
        faults = verify_checkpoint(ckpt)
        if faults:
            raise CheckpointError("\n".join(faults))
        manifest = read_manifest(ckpt)
        if manifest.layers_only:
            raise InputError(f"{path}: holds layers only (retention dropped its head and state; later checkpoints "
                             f"compose layers from it): give a full checkpoint, or the run")
    faults = Checkpoints(run_dir).source_faults(ckpt, cached=False)
    if faults:
        raise CheckpointError(f"{ckpt}: composes its layers from damaged checkpoints:\n  " + "\n  ".join(faults))
    return run_dir, ckpt, manifest
