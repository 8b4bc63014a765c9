"""The phase table a schedule plans, and the batch check each phase's process count must pass."""

from __future__ import annotations

from pathlib import Path

from orchestrator import importance, units
from orchestrator.choose import chooser, drawable
from orchestrator.errors import ScheduleError
from orchestrator.schedule import DataSection, LoadedSchedule, Phase
from orchestrator.sections import MAX_STEPS

MAX_PHASES = 100_000
"""A schedule of more phases is refused: at a second or more per switch, more than a day of switching."""
MAX_PLANNED_LAYERS = 10_000_000
"""Phases x layers_per_phase, the size of the phase table a strategy builds."""


def check_batch(data: DataSection, nproc: int, source: Path, phase: int, *, nnodes: int = 1) -> None:
    """batch_size must split into whole micro-batches on every process: gradient accumulation is an integer."""
    world = nproc * nnodes
    per_step = data.micro_batch_size * world
    if data.batch_size % per_step:
        nodes = f" ({nproc} per node x {nnodes} nodes)" if nnodes > 1 else ""
        raise ScheduleError(
            f"{source}: data.batch_size: expected a multiple of micro_batch_size x processes = "
            f"{data.micro_batch_size} x {world}{nodes} = {per_step}, got {data.batch_size} (phase {phase})"
        )


def _check_steps(loaded: LoadedSchedule, total: int | None) -> None:
    """The run's steps in all: at least one, and what a checkpoint's name (step-NNNNNNNN) can count."""
    sc = loaded.schedule.schedule
    if sc.phases is not None and total > MAX_STEPS:
        raise ScheduleError(f"{loaded.source}: schedule.phases: expected at most {MAX_STEPS:,} steps in all (a "
                            f"checkpoint is step-NNNNNNNN), got {total:,}")
    if sc.phases is None and (not total or total > MAX_STEPS):  # only schedule.epochs makes either: the rest is bounded
        rows = (loaded.data_check or {}).get("stats", {}).get("train", {}).get("rows")
        raise ScheduleError(f"{loaded.source}: schedule.epochs: {sc.epochs:g} epochs of {rows:,} rows at data.batch_size "
                            f"{loaded.schedule.data.batch_size:,} make {total:,} steps; expected 1 to {MAX_STEPS:,}")


def check_warmup(loaded: LoadedSchedule, phases: list[Phase]) -> None:
    """A warm-up longer than the run would end it before its learning rate is reached."""
    warmup, total = loaded.schedule.lr_schedule.warmup_steps, phases[-1].end_step
    if warmup > total:
        raise ScheduleError(f"{loaded.source}: lr_schedule.warmup_steps: expected at most the run's {total:,} steps, "
                            f"got {warmup:,} (the run would end before reaching optimizer.lr)")


def plan_phases(loaded: LoadedSchedule) -> list[Phase]:
    """The phase table; the same schedule and seed give the same table, always."""
    s = loaded.schedule
    nproc_default = loaded.nproc_override or s.launch.nproc
    if s.schedule.phases is not None:
        phases, step = [], 0
        for i, p in enumerate(s.schedule.phases):
            nproc = loaded.nproc_override or p.nproc or s.launch.nproc
            phases.append(Phase(index=i, start_step=step, end_step=step + p.steps, layers=p.trained_layers,
                                modules=tuple(p.modules or ()), nproc=nproc))
            step += p.steps
        _check_steps(loaded, step)
        return phases
    sc, total = s.schedule, loaded.total_steps
    _check_steps(loaded, total)
    if sc.strategy == "misa":
        return _by_modules(loaded, total)
    n, k = loaded.num_layers, sc.layers_per_phase
    assert sc.interval and k
    if k > n:
        raise ScheduleError(f"{loaded.source}: schedule.layers_per_phase: expected at most the model's {n} layers, "
                            f"got {k}")
    _phase_count(loaded, total, k)
    layers_of = chooser(sc.strategy, n, k, s.run.seed, _weights(loaded, n, k), sc.window)
    by_norm = importance.planned(loaded, n, k) if sc.by_importance else None
    phases, step, i = [], 0, 0
    while step < total:
        end = min(step + sc.interval, total)
        layers, later = by_norm(i) if by_norm else (layers_of(i), False)
        phases.append(Phase(index=i, start_step=step, end_step=end, layers=layers, nproc=nproc_default,
                            drawn_later=later))
        step, i = end, i + 1
    return phases


def _phase_count(loaded: LoadedSchedule, total: int, k: int) -> int:
    """A strategy's table: at most MAX_PHASES phases, MAX_PLANNED_LAYERS layers over them; its phases."""
    interval = loaded.schedule.schedule.interval
    count = -(-total // interval)
    if count > MAX_PHASES:
        raise ScheduleError(f"{loaded.source}: schedule.interval: expected at most {MAX_PHASES:,} phases, got "
                            f"total_steps / interval = {total:,} / {interval:,} = {count:,} phases")
    if count * k > MAX_PLANNED_LAYERS:
        raise ScheduleError(f"{loaded.source}: schedule.layers_per_phase: expected at most {MAX_PLANNED_LAYERS:,} "
                            f"layers over all phases, got {count:,} phases x {k:,}")
    return count


def _by_modules(loaded: LoadedSchedule, total: int) -> list[Phase]:
    """Strategy misa's phases: each its module units, drawn (``orchestrator.units.Misa``)."""
    s, interval = loaded.schedule, loaded.schedule.schedule.interval
    count = _phase_count(loaded, total, 1)
    draw, phases, step = units.Misa(loaded), [], 0
    if count * len(draw.units) > MAX_PLANNED_LAYERS:
        raise ScheduleError(f"{loaded.source}: schedule.interval: expected phases x the model's module units of at "
                            f"most {MAX_PLANNED_LAYERS:,}, got {count:,} phases x {len(draw.units):,} units")
    while step < total:
        layers, modules = draw(len(phases))  # with unit_weights = "grad_norm", stand-ins from phase importance_lag on
        phases.append(Phase(index=len(phases), start_step=step, end_step=min(step + interval, total), layers=layers,
                            modules=modules, nproc=loaded.nproc_override or s.launch.nproc,
                            drawn_later=s.schedule.by_importance and len(phases) >= s.schedule.importance_lag))
        step = phases[-1].end_step
    return phases


def _weights(loaded: LoadedSchedule, n: int, k: int) -> list[float] | None:
    """schedule.layer_weights as a list (None: uniform), checked against the model's layers and
    schedule.window."""
    sc, source = loaded.schedule.schedule, loaded.source
    weights = None if sc.layer_weights in (None, "uniform", "grad_norm") else list(sc.layer_weights)
    if weights is not None and len(weights) != n:
        raise ScheduleError(f"{source}: schedule.layer_weights: expected a weight per body layer, {n}, "
                            f"got {len(weights)}")
    need, key = k * (sc.window or 1), "schedule.window" if sc.window else "schedule.layer_weights"
    if drawable(n, weights) < need:
        what = f"window x layers_per_phase = {sc.window} x {k}" if sc.window else f"layers_per_phase = {k}"
        raise ScheduleError(f"{source}: {key}: expected at most {drawable(n, weights)} layers drawn "
                            f"{'per window' if sc.window else 'per phase'} (the layers of weight > 0), got {what}")
    return weights
