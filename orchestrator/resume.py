"""Where a run stands: the newest checkpoint that is whole, the work after it, and the checkpoint
``--resume-from`` names instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from launch.contract.files import RunDir

from orchestrator.errors import ScheduleError
from orchestrator.groups import Work
from orchestrator.rundir import SCHEDULE_COPY
from orchestrator.schedule import Phase
from shard_tools.errors import InputError
from shard_tools.files import write_atomic
from shard_tools.history import replay
from shard_tools.manifest import Manifest, step_of
from shard_tools.store import Checkpoints


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


def restore_point(store: Checkpoints, event: Callable[..., None]) -> tuple[Path | None, Manifest | None]:
    """The newest checkpoint that is whole, and whose layer sources are whole too (``Checkpoints.restore_point``).

    Damaged ones are journaled and skipped, never deleted. Checksums are read once per
    checkpoint per orchestrator: what this process verified or committed stays trusted.
    """
    point = store.restore_point()
    for ckpt, fault in point.skipped:
        event("checkpoint_skipped", checkpoint=str(ckpt), fault=fault)
    return point.path, point.manifest


def resume_point(run_dir: Path, given: Path) -> Path:
    """The checkpoint --resume-from names, checked before anything is written: one of this run's,
    whole (checksums), and so are the layer files it builds on."""
    if not (run_dir / SCHEDULE_COPY).is_file():
        raise ScheduleError(f"--resume-from: {run_dir} holds no run to resume")
    try:
        return Checkpoints(run_dir).resume_point(given)
    except InputError as e:
        raise ScheduleError(f"--resume-from: {e}") from None


def set_aside_after(store: Checkpoints, chosen: Path, event: Callable[..., None]) -> None:
    """--resume-from: the checkpoints after ``chosen`` move to checkpoints/.set-aside-<time>/, where
    readers and retention do not look and nothing deletes them, and so do the lines of metrics.jsonl
    after its step (into a metrics.jsonl there), so that the run's metrics hold one history."""
    aside = store.set_aside_after(chosen)
    if aside is None:
        return
    metrics = RunDir(store.run_dir).metrics
    keep, after = metrics_split(metrics, step_of(chosen))
    if after:
        write_atomic(aside.folder / metrics.name, b"".join(after))
        write_atomic(metrics, b"".join(keep))
    event("checkpoints_set_aside", resume_from=str(chosen), to=str(aside.folder), checkpoints=aside.checkpoints,
          metrics_lines=len(after))


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


def journal_recovered(journal: list[dict], step: int, event: Callable[..., None]) -> None:
    """Phases that ended by the restore point ``step`` but were never journaled done: an
    orchestrator killed between a phase's commit and its journaling (``orchestrator.commit``), or a
    phase stopped after its last checkpoint was whole. Journaled done now, ``recovered``, without
    the records of a process nobody saw end."""
    for row in replay(journal):
        if row.status != "done" and row.end_step <= step:
            event("phase_done", phase=row.index, step=row.end_step, layers=row.layers, nproc=row.nproc,
                  records={}, recovered=True)
