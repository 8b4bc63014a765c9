"""Where a run stands: the newest checkpoint that is whole, the work after it, and the checkpoint
``--resume-from`` names instead."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from launch.contract import RunDir

from orchestrator import final
from orchestrator.errors import ScheduleError
from orchestrator.groups import Work
from orchestrator.rundir import SCHEDULE_COPY
from orchestrator.schedule import Phase
from shard_tools.manifest import (
    STEP_DIR_SHAPE, CheckpointError, Manifest, checkpoints_dir, fsync_path, is_checkpoint_dir, layer_sources, list_checkpoints,
    read_manifest, step_of, verify_checkpoint,
)
from shard_tools.files import write_atomic


def next_work(phases: list[Phase], ckpt: Path | None, manifest: Manifest | None) -> Work | None:
    if manifest is None:
        return Work(phases[0], 0, None)
    g = manifest.global_step
    if manifest.phase_complete:
        for ph in phases:
            if ph.start_step == g:
                return Work(ph, g, ckpt)
        if g >= phases[-1].end_step:
            return None
        raise ScheduleError(f"the newest checkpoint ends a phase at step {g}, where no phase of the schedule starts")
    ph = next((p for p in phases if p.start_step <= g < p.end_step), None)
    if ph is None or ph.index != manifest.phase or list(ph.layers) != manifest.layers:
        raise ScheduleError(
            f"the newest checkpoint is inside phase {manifest.phase} (layers {manifest.layers}) at step {g}, "
            f"which the schedule no longer has"
        )
    return Work(ph, g, ckpt)


def restore_point(run_dir: Path, verified: set[Path],
                  event: Callable[..., None]) -> tuple[Path | None, Manifest | None]:
    """The newest checkpoint that is whole, and whose layer sources are whole too.

    Damaged ones are journaled and skipped, never deleted. Checksums are read once per
    checkpoint per orchestrator: what this process verified or committed (``verified``) stays trusted.
    """
    for ckpt in reversed(list_checkpoints(run_dir)):
        faults = _verify(ckpt, verified)
        if not faults:
            try:
                sources = set(layer_sources(run_dir, ckpt).values()) - {ckpt}
                faults = [f for src in sorted(sources) for f in _verify(src, verified)]
            except CheckpointError as e:
                faults = [str(e)]
        if not faults:
            return ckpt, read_manifest(ckpt)
        for fault in faults:
            event("checkpoint_skipped", checkpoint=str(ckpt), fault=fault)
    return None, None


def _verify(ckpt: Path, verified: set[Path]) -> list[str]:
    if ckpt in verified:
        return []
    faults = verify_checkpoint(ckpt)
    if not faults:
        verified.add(ckpt)
    return faults


def resume_point(run_dir: Path, given: Path) -> Path:
    """The checkpoint --resume-from names, checked before anything is written: one of this run's,
    whole (checksums), and so are the layer files it builds on."""
    ckpt = Path(given).resolve()
    if not (run_dir / SCHEDULE_COPY).is_file():
        raise ScheduleError(f"--resume-from: {run_dir} holds no run to resume")
    if ckpt.parent != checkpoints_dir(run_dir).resolve() or not is_checkpoint_dir(ckpt):
        raise ScheduleError(f"--resume-from: expected a checkpoint of this run "
                            f"({checkpoints_dir(run_dir)}/{STEP_DIR_SHAPE}), got {given}")
    try:
        faults = [f for src in sorted({ckpt, *layer_sources(run_dir, ckpt).values()}) for f in verify_checkpoint(src)]
    except CheckpointError as e:
        faults = [str(e)]
    if faults:
        raise ScheduleError(f"--resume-from: {given} is not whole:\n  " + "\n  ".join(faults))
    return checkpoints_dir(run_dir) / ckpt.name


def set_aside_after(run_dir: Path, chosen: Path, verified: set[Path], event: Callable[..., None]) -> None:
    """--resume-from: the checkpoints after ``chosen`` move to checkpoints/.set-aside-<time>/, where
    readers and retention do not look and nothing deletes them, and so do the lines of metrics.jsonl
    after its step (into a metrics.jsonl there), so that the run's metrics hold one history."""
    later = [c for c in list_checkpoints(run_dir) if step_of(c) > step_of(chosen)]
    keep, metrics_after = metrics_split(RunDir(run_dir).metrics, step_of(chosen))
    if not later and not metrics_after and not (run_dir / final.FINAL).exists():
        return
    aside = checkpoints_dir(run_dir) / f".set-aside-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    aside.mkdir(mode=0o750)
    for ckpt in later:
        os.replace(ckpt, aside / ckpt.name)
    if (run_dir / final.FINAL).exists():  # made from the later checkpoints; the run writes it anew
        os.replace(run_dir / final.FINAL, aside / final.FINAL)
    if metrics_after:
        write_atomic(aside / RunDir(run_dir).metrics.name, b"".join(metrics_after))
        write_atomic(RunDir(run_dir).metrics, b"".join(keep))
    fsync_path(checkpoints_dir(run_dir))
    verified.add(chosen)
    event("checkpoints_set_aside", resume_from=str(chosen), to=str(aside), checkpoints=[c.name for c in later],
          metrics_lines=len(metrics_after))


def metrics_split(path: Path, step: int) -> tuple[list[bytes], list[bytes]]:
    """metrics.jsonl's lines as (those up to ``step``, those of later steps); a line that is not a
    record with a step (a torn one) stays."""
    keep, after = [], []
    lines = path.read_bytes().splitlines(keepends=True) if path.is_file() else []
    for line in lines:
        try:
            at = json.loads(line).get("step")
        except (ValueError, AttributeError):
            at = None
        (after if isinstance(at, int) and at > step else keep).append(line)
    return keep, after
