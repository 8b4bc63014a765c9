"""``shard-tools verify``: is every file of a checkpoint, or of every checkpoint of a run, present with
the size and sha256 its manifest records?

    shard-tools verify runs/tiny                              # exit 1 naming each faulty file
    shard-tools verify runs/tiny/checkpoints/step-00000030

No torch here: checksums are over the files' bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shard_tools.errors import CheckpointError, InputError
from shard_tools.manifest import CHECKPOINTS, STEP_DIR_SHAPE, Manifest, path_kind, read_manifest, step_of, verify_checkpoint
from shard_tools.store import Checkpoints


@dataclass
class Report:
    checkpoints: list[Path]
    faults: list[str]
    files: int
    bytes: int


def verify_path(path: Path) -> Report:
    path = Path(path)
    is_run = path_kind(path) == "run"
    checkpoints = Checkpoints(path).all() if is_run else [path]
    report = Report(checkpoints, [], 0, 0)
    for ckpt in checkpoints:
        faults = verify_checkpoint(ckpt)
        report.faults += faults
        if not faults:
            sizes = [e.size for e in read_manifest(ckpt).files.values()]
            report.files += len(sizes)
            report.bytes += sum(sizes)
    if is_run:
        report.faults += [f"{p}: stray temporary left by an interrupted writer (the orchestrator removes it on its "
                          f"next run)" for p in Checkpoints(path).stray_temporaries()]
    return report


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
