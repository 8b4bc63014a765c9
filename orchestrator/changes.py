"""What a schedule may change of a run already under way: anything about its future, nothing that
alters the work already done (unless forced)."""

from __future__ import annotations

import bisect
from types import SimpleNamespace

from launch.contract.spec import lr_at

from orchestrator.dsconfig import recorded_raw
from orchestrator.errors import ScheduleError
from orchestrator.rundir import SCHEDULE_COPY
from orchestrator.plan import plan_phases
from orchestrator.schedule import LoadedSchedule, Phase
from orchestrator.validate import validate_schedule
from shard_tools.history import read_journal
from shard_tools.store import Checkpoints

# Where and how the work runs does not change what it computes, nor do evaluation (its cadence, its
# data), reporting and retention; phases and the lr are compared apart.
HARMLESS = ("schedule.", "launch.", "checkpoint.", "deepspeed.zero_stage", "lr_schedule.", "optimizer.lr:",
            "run.final_model", "run.group_readable", "run.report_to", "run.tensorboard",
            "data.eval_every", "data.validation_path", "eval.")


def schedule_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}{key}"
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += schedule_differences(a, b, path + ".")
        elif a != b:
            diffs.append(f"{path}: {a!r} -> {b!r}")
    return diffs


def without_output_dir(raw: dict) -> dict:
    run = raw.get("run", {})
    return {**raw, "run": {k: v for k, v in run.items() if k != "output_dir"}} if isinstance(run, dict) else raw


def warmup_ran(run_dir) -> str | None:
    """The lr_schedule.warmup_from the run's last start trained with, as its journal says; "one_step"
    where it says none (started before the key: its warm-up was that); None before any start."""
    starts = [e for e in read_journal(run_dir) if e["event"] in ("run_started", "resumed")]
    return starts[-1].get("warmup_from", "one_step") if starts else None


def changed_lr(old: LoadedSchedule, old_phases: list[Phase], new: LoadedSchedule, new_phases: list[Phase],
               done_step: int, old_warmup_from: str | None = None) -> str | None:
    """How the lr of a step already taken would change (a new total_steps moves a decaying lr), or None.
    ``old_warmup_from``: the warm-up the run trained with, where not its schedule's (``warmup_ran``)."""
    def opt(loaded: LoadedSchedule, phases: list[Phase], warmup_from: str | None = None) -> SimpleNamespace:
        s = loaded.schedule
        return SimpleNamespace(lr=s.optimizer.lr, lr_kind=s.lr_schedule.kind, warmup_steps=s.lr_schedule.warmup_steps,
                               total_steps=phases[-1].end_step, warmup_from=warmup_from or s.lr_schedule.warmup_from,
                               phase_warmup_steps=s.lr_schedule.phase_warmup_steps,
                               starts=[p.start_step for p in phases])

    def lr(step: int, o: SimpleNamespace) -> float:
        return lr_at(step, o, o.starts[max(bisect.bisect_right(o.starts, step) - 1, 0)])

    def said(o: SimpleNamespace) -> str:
        return (f"lr {o.lr:g}, {o.lr_kind}, warmup_steps {o.warmup_steps} from {o.warmup_from}, total_steps "
                f"{o.total_steps}" + (f", phase_warmup_steps {o.phase_warmup_steps}" if o.phase_warmup_steps else ""))

    a, b = opt(old, old_phases, old_warmup_from), opt(new, new_phases)
    for step in range(done_step):
        if lr(step, a) != lr(step, b):
            return (f"lr of step {step}, already taken, would change: {lr(step, a):.6g} -> {lr(step, b):.6g} "
                    f"({said(a)} -> {said(b)})")
    return None


def check_same_schedule(loaded: LoadedSchedule, phases: list[Phase], old_raw: dict, force: bool) -> list[str]:
    """Refuses ``loaded`` (the schedule given now, planned as ``phases``) where it differs from the
    run's copy ``old_raw`` in ways that alter completed work, unless ``force``; returns the
    differences accepted (none where it is the same)."""
    run_dir = loaded.output_dir
    diffs = schedule_differences(without_output_dir(old_raw), without_output_dir(recorded_raw(loaded)))
    ran_from = warmup_ran(run_dir)
    if not diffs and ran_from in (None, loaded.schedule.lr_schedule.warmup_from):
        return diffs
    _, manifest, _ = Checkpoints(run_dir).newest_whole(checksums=False)
    done_step = manifest.global_step if manifest else 0
    try:
        old_loaded = validate_schedule(old_raw, loaded.source)
        old_planned = plan_phases(old_loaded)
    except ScheduleError as e:
        # Messages name the user's file: the copy's relative paths are resolved from there.
        raise ScheduleError(f"{run_dir / SCHEDULE_COPY}: the schedule this run was started with is no "
                            f"longer valid (edited?): {e}") from None
    old_phases = [p for p in old_planned if p.start_step < done_step]
    new_phases = [p for p in phases if p.start_step < done_step]
    changes_done = [d for d in diffs if not d.startswith(HARMLESS)]
    lr_change = changed_lr(old_loaded, old_planned, loaded, phases, done_step, ran_from)
    if lr_change and ran_from != loaded.schedule.lr_schedule.warmup_from:
        lr_change += f"; its warm-up ran from {ran_from}: --set lr_schedule.warmup_from={ran_from} resumes it so"
    if lr_change:
        changes_done.append(lr_change)
    same_done = [(p.start_step, p.end_step, p.layers, p.modules) for p in old_phases] == [
        (p.start_step, p.end_step, p.layers, p.modules) for p in new_phases]
    if not same_done:
        changes_done.append("schedule: phases already run (in part or whole) differ")
    if changes_done and not force:
        raise ScheduleError(
            f"{loaded.source}: differs from the schedule this run was started with "
            f"({run_dir / SCHEDULE_COPY}) in ways that alter completed work:\n  "
            + "\n  ".join(diffs + [lr_change] * bool(lr_change)) + "\nuse --force to go on anyway"
        )
    return diffs
