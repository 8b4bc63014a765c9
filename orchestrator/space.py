"""The run directory's disk need at its peak and the free space of its file system: ``plan`` shows
both, ``run`` refuses (exit 2, before any phase process starts) where the need exceeds the free space.

Sizes follow orchestrator/estimate.py's parameter counts:

    a checkpoint   head x 12 bytes (fp32 master, exp_avg, exp_avg_sq) + the phase's layers x per_layer x 4
                   (their fp32 masters; x 12 under schedule.optimizer_state "keep", their kept Adam
                   moments beside them); a stop's mid-phase checkpoint also the body's Adam moments (x 8);
                   where phase ends may write none (``carries``), every layer the run trains (a
                   checkpoint holds the layers trained since the last one), and the layers-only
                   sources then at most one more copy of each (an estimate, not a bound); and at
                   most as many layer copies as the run writes (``layer_writes``: each phase's
                   layers land in one checkpoint, again at each of its mid-phase ones and a stop's)
    checkpoints    (keep_last + 1) checkpoints (retention runs after the next one is durable); where
                   every phase end writes, launch.prewarm_depth more with pre-warming (retention
                   spares each waiting phase's preload, which with short phases is older than
                   keep_last: 5 whole at once at 1.1B, 2-s phases, keep_last 2, depth 3, on an H200;
                   under a cadence the preloads are the newest); and the layers files of the older
                   checkpoints retention keeps as layer sources (``layer_sources``)
    data cache     the prepared rows: int32 input_ids and labels per token, two int32 per row
    final model    every parameter in model.dtype, where run.final_model

The run directory's files already there (a resume) count towards the need: what it holds is not
needed again. The run's metrics, journal and logs are small beside these and not counted.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from launch.contract.cadence import end_writes
from launch.contract.files import DATA_CACHE
from orchestrator.errors import ScheduleError
from orchestrator.estimate import (
    ADAM_BYTES, DTYPE_BYTES, MASTER_BYTES, EstimateError, ParamCount, model_config, param_count, trained_head,
)
from orchestrator.schedule import LoadedSchedule, Phase, cadence_seconds
from shard_tools.manifest import CHECKPOINTS, FINAL
from shard_tools.sizes import format_bytes

ROW_BYTES_PER_TOKEN = 8  # int32 input_ids and labels
ROW_BYTES = 8  # int32 lengths and targets


@dataclass(frozen=True)
class DiskNeed:
    """Bytes the run directory holds at its peak, by part."""

    checkpoints: int
    data_cache: int
    final: int

    @property
    def total(self) -> int:
        return self.checkpoints + self.data_cache + self.final


def data_cache_bytes(stats: list[dict | None]) -> int:
    """The prepared rows of each split's statistics (``orchestrator data``'s)."""
    return sum(st["rows"] * (st["seq_len"] * ROW_BYTES_PER_TOKEN + ROW_BYTES) for st in stats if st)


def trained_layers(phases: list[Phase]) -> int:
    """How many distinct layers the run trains."""
    return len({layer for p in phases for layer in p.layers})


def layer_sources(phases: list[Phase], keep_last: int) -> int:
    """The older checkpoints retention keeps for their layers alone, at most: one for each layer
    trained (its newest copy, which the newest checkpoint composes) and, for each older kept
    checkpoint, one for each layer a newer kept one retrained; no more than the checkpoints beyond keep_last."""
    trained = trained_layers(phases)
    widest = max(len(p.layers) for p in phases)
    return min(trained + (keep_last - 1) * widest, max(len(phases) - keep_last, 0))


def layer_writes(loaded: LoadedSchedule, phases: list[Phase]) -> int:
    """How many layer copies the run's checkpoints hold at most where a phase end may write none, the
    kept whole ones and the layers-only sources together: each phase's layers after it (in the next
    checkpoint, which holds what was trained since the one before) and at each of its mid-phase
    checkpoints (``checkpoint.every_steps``), and the layers of a stop's."""
    every = loaded.schedule.checkpoint.every_steps
    ends = sum(len(p.layers) * (1 + ((p.end_step - p.start_step - 1) // every if every else 0)) for p in phases)
    return ends + max(len(p.layers) for p in phases)


def carries(loaded: LoadedSchedule) -> bool:
    """Whether a phase end may write no checkpoint, its successor carrying its layers on
    (``checkpoint.every_seconds`` with a handover)."""
    s = loaded.schedule
    hands_over = s.launch.handover != "off" and s.launch.prewarm and s.launch.nnodes == 1
    return not end_writes(due=cadence_seconds(s) == 0, takes=hands_over)


def write_rate(loaded: LoadedSchedule, phases: list[Phase]) -> str | None:
    """``plan``'s line on how much the run writes: at every phase end, or at most every every_seconds."""
    try:
        count = param_count(model_config(loaded))
    except EstimateError:
        return None
    head, every = trained_head(loaded, count), loaded.schedule.checkpoint.every_seconds
    widest = max(len(p.layers) for p in phases)
    phase_end = format_bytes(_full(count, head, widest, _per_layer_param(loaded)))
    if not carries(loaded):
        return f"checkpoints: every phase end writes up to {phase_end} (checkpoint.every_seconds = {every:g})"
    most = _full(count, head, trained_layers(phases))
    return (f"checkpoints: where the state is handed over, one at most every {every:g} s (checkpoint.every_seconds) "
            f"of up to {format_bytes(most)} (the head and every layer trained since the last): at most "
            f"{format_bytes(int(most / every))}/s; else every phase end writes up to {phase_end}")


def _full(count: ParamCount, head: int, layers: int, per_param: int = MASTER_BYTES) -> int:
    return head * ADAM_BYTES + layers * count.per_layer * per_param


def _per_layer_param(loaded: LoadedSchedule) -> int:
    """A layers file's bytes per parameter: its fp32 master, and under "keep" its kept moments."""
    return ADAM_BYTES if loaded.schedule.schedule.optimizer_state == "keep" else MASTER_BYTES


def disk_need(loaded: LoadedSchedule, phases: list[Phase], data_bytes: int) -> DiskNeed | None:
    """The run directory's peak with ``data_bytes`` of prepared rows; None where the model's
    family has no parameter count (``plan`` warns of it)."""
    s = loaded.schedule
    try:
        count = param_count(model_config(loaded))
    except EstimateError:
        return None
    widest = max(len(p.layers) for p in phases)
    held = trained_layers(phases) if carries(loaded) else widest
    per_param, head = _per_layer_param(loaded), trained_head(loaded, count)
    stop = widest * count.per_layer * (ADAM_BYTES - MASTER_BYTES)  # a stop's body optimizer state
    # Retention runs once the next checkpoint is durable: keep_last + 1 for a while, and spares the
    # waiting phases' preloads. An older checkpoint kept as a layer source keeps its layers file alone.
    ahead = s.launch.prewarm_depth if s.launch.prewarm and not carries(loaded) else 0
    kept = min(s.checkpoint.keep_last + 1 + ahead, len(phases) + 1)
    sources = layer_sources(phases, s.checkpoint.keep_last) * widest  # layer copies in the older ones
    if carries(loaded):  # the layers-only sources beside checkpoints of every layer: about one more copy of each
        sources = min(sources, held)
    layers = kept * held + sources
    if carries(loaded):  # and no more copies than the run writes
        layers = min(layers, layer_writes(loaded, phases))
    final = count.total * DTYPE_BYTES[s.model.dtype] if s.run.final_model else 0
    return DiskNeed(checkpoints=kept * _full(count, head, 0) + _full(count, 0, layers, per_param) + stop,
                    data_cache=data_bytes, final=final)


@dataclass(frozen=True)
class FileSystem:
    mount: Path
    """Where the file system holding the run directory is mounted."""
    free: int
    """Bytes free to an unprivileged writer (statvfs f_bavail)."""


def file_system_of(path: Path) -> FileSystem:
    """The file system ``path`` is on, or would be made on (its nearest existing parent's)."""
    path = next(p for p in (path, *path.parents) if p.exists()).resolve()
    dev, mount = path.stat().st_dev, path
    while mount.parent != mount and mount.parent.stat().st_dev == dev:
        mount = mount.parent
    return FileSystem(mount=mount, free=shutil.disk_usage(path).free)


NEARLY_FULL = 64 << 20
"""Free bytes under which a failure's message says the run directory's file system is full."""


def full_disk(path: Path) -> list[str]:
    """A line saying that ``path``'s file system is (nearly) full, where it is: a fault's likely cause."""
    try:
        fs = file_system_of(path)
    except OSError:
        return []
    return [f"the file system of {path} ({fs.mount}) is full: {format_bytes(fs.free)} free"] if fs.free < NEARLY_FULL else []


def held_bytes(*roots: Path) -> int:
    """Bytes the files under ``roots`` take now."""
    total = 0
    for root in roots:
        for folder, _dirs, files in os.walk(root):
            total += sum(os.lstat(os.path.join(folder, f)).st_size for f in files)
    return total


def describe(need: DiskNeed, fs: FileSystem) -> str:
    """``plan``'s line: the peak need by part, and the file system's free space."""
    return (f"disk: the run directory needs {format_bytes(need.total)} at its peak (checkpoints "
            f"{format_bytes(need.checkpoints)}, data cache {format_bytes(need.data_cache)}, final model "
            f"{format_bytes(need.final)}); {fs.mount} has {format_bytes(fs.free)} free")


def check_space(loaded: LoadedSchedule, phases: list[Phase], staged: Path | None) -> None:
    """ScheduleError (exit 2) where the run directory's file system cannot take what the run still
    needs; ``staged``: the data a new run prepared (else the run directory's data cache counts)."""
    data = held_bytes(staged) if staged else held_bytes(loaded.output_dir / DATA_CACHE)
    need = disk_need(loaded, phases, data)
    if need is not None and (why := shortfall(loaded, need, staged)) is not None:
        raise ScheduleError(why)


def shortfall(loaded: LoadedSchedule, need: DiskNeed, staged: Path | None = None) -> str | None:
    """Why ``run`` refuses (``plan`` too, with exit 2) where the run directory's file system cannot
    take ``need`` beyond what the run directory (and ``staged``) holds already; None where it can."""
    fs = file_system_of(loaded.output_dir)
    run = loaded.output_dir
    more = need.total - held_bytes(run / CHECKPOINTS, run / DATA_CACHE, run / FINAL, *([staged] if staged else []))
    if more <= fs.free:
        return None
    return (f"{loaded.output_dir}: the run needs {format_bytes(more)} more disk space at its peak "
            f"({format_bytes(need.total)} in all: checkpoints {format_bytes(need.checkpoints)}, data "
            f"cache {format_bytes(need.data_cache)}, final model {format_bytes(need.final)}); "
            f"{fs.mount} has {format_bytes(fs.free)} free")
