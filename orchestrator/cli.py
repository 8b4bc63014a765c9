"""The ``orchestrator`` command: run, plan, data, status, report. Domain errors become exit codes only here."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import click

from orchestrator.errors import RelayerError
from shard_tools.errors import CheckpointError, InputError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except RelayerError as e:
            _fail(e, e.exit_code)
        except InputError as e:  # the format package's, where a command reads a run (report, status)
            _fail(e, 2)
        except CheckpointError as e:
            _fail(e, 1)
        except OSError as e:
            if e.errno != errno.ENAMETOOLONG:
                raise
            # Only a name the user gave (a key, an argument, or a path made from one) is too long
            # for the file system: bad input, found before anything is written at that name.
            _fail(f"{e.filename}: a name longer than the file system allows ({e.strerror})", 2)


def _fail(error: Exception, code: int) -> None:
    try:
        click.echo(f"orchestrator: {error}", err=True)
    except OSError:  # the terminal closed (SIGHUP): the exit code and the journal still say it
        pass
    sys.exit(code)


@click.group(cls=_Group)
def main() -> None:
    """relayer's control plane: runs LISA-style schedules, one fresh process group per phase."""


schedule_arg = click.argument("schedule", type=click.Path(dir_okay=False, path_type=Path))
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help="Override a schedule key (TOML value): --set optimizer.lr=3e-4 "
                               "--set schedule.phases[0].steps=5. Repeatable.")


output_dir_option = click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
                                 help="Run directory (overrides run.output_dir); plan and data read its prepared data.")


@main.command()
@schedule_arg
@output_dir_option
@click.option("--nproc", type=int, help="Processes for every phase (overrides launch.nproc and per-phase nproc).")
@click.option("--force", is_flag=True, help="Resume even though the schedule changed completed work.")
@set_option
@click.option("--resume-from", type=click.Path(file_okay=False, path_type=Path), metavar="CHECKPOINT",
              help="Continue from this checkpoint of the run (RUN_DIR/checkpoints/step-N); the later ones are "
                   "moved to checkpoints/.set-aside-<time>/, not deleted.")
def run(schedule: Path, output_dir: Path | None, nproc: int | None, force: bool, overrides: tuple[str, ...],
        resume_from: Path | None) -> None:
    """Run every phase of SCHEDULE; resume from the newest valid checkpoint if the run has progress."""
    from orchestrator.display import Display
    from orchestrator.runner import run_schedule
    from orchestrator.validate import load_schedule

    loaded = load_schedule(schedule, output_dir=output_dir, nproc=nproc, overrides=overrides)
    display = Display(loaded)
    with display:
        run_schedule(loaded, force=force, on_event=display.event, observer=display, resume_from=resume_from)
    click.echo(f"run complete: {loaded.output_dir}")


@main.command()
@schedule_arg
@output_dir_option
@click.option("--nproc", type=int, help="Processes for every phase.")
@click.option("--device-memory", metavar="SIZE",
              help="Memory of one device (80GiB, 80GB, 141e9), over launch.device_memory: adds each phase's "
                   "estimated memory per process, shows how each switch goes within it, and exits 2 where a "
                   "phase will not fit, naming what would.")
@set_option
def plan(schedule: Path, output_dir: Path | None, nproc: int | None, device_memory: str | None,
         overrides: tuple[str, ...]) -> None:
    """Print the phase table of SCHEDULE, how each switch hands over, and check the file, without
    starting anything."""
    from orchestrator.budget import budget_line, budget_of
    from orchestrator.datastep import check_data
    from orchestrator.display import largest_phase, print_plan
    from orchestrator.estimate import EstimateError, estimate_plan, size_option
    from orchestrator.handover import plan_switches
    from orchestrator.plan import plan_phases
    from orchestrator.validate import load_schedule

    option = size_option(device_memory, "--device-memory") if device_memory is not None else None
    loaded = load_schedule(schedule, output_dir=output_dir, nproc=nproc, overrides=overrides, device_memory=option)
    budget = budget_of(loaded, option)
    device = budget.size if budget is not None else None
    phases = plan_phases(loaded)
    data = check_data(loaded)
    try:
        estimate, failure = estimate_plan(loaded, phases), None
    except EstimateError as e:
        estimate, failure = None, e
    switches = plan_switches(loaded, phases, estimate, device, memory_name=budget.name if budget else "--device-memory")
    here = _on_this_machine(loaded, phases, estimate, budget_of(loaded))
    if device is None:
        print_plan(loaded, phases, switches, here=here)
        if estimate is not None:
            click.echo(largest_phase(phases, estimate))
        _echo_data_line(loaded, phases, data)
        return
    if estimate is None:
        print_plan(loaded, phases, switches, here=here)
        click.echo(f"orchestrator: warning: no memory estimate: {failure}", err=True)
        return
    print_plan(loaded, phases, switches, estimate, device, here=here)
    click.echo(budget_line(loaded, phases, estimate, budget))
    _echo_data_line(loaded, phases, data)
    if estimate.unsized:
        click.echo(f"orchestrator: warning: the estimate counts nothing for model.persistent "
                   f"{', '.join(estimate.unsized)}", err=True)


def _on_this_machine(loaded, phases, estimate, budget) -> tuple[str, list]:
    """What this machine is, in words, and how each switch goes on it (no GPU: through the checkpoint;
    within launch.device_memory where it is less than this GPU's)."""
    from orchestrator.handover import plan_switches
    from orchestrator.machine import this_machine

    machine = this_machine()
    memory, name = machine.memory, "this GPU's"
    if budget is not None and machine.gpus and (memory is None or budget.size < memory):
        memory, name = budget.size, budget.name
    return _machine_words(machine), plan_switches(loaded, phases, estimate, memory, not machine.gpus, name)


def _machine_words(machine) -> str:
    """What plan says this machine offers the phases: ``no GPU: DS_ACCELERATOR=cpu``, ``1 GPU of 140 GiB (NVML)``."""
    from shard_tools.sizes import format_bytes

    if not machine.gpus:
        return f"no GPU: {machine.told_by}"
    memory = f" of {format_bytes(machine.memory)}" if machine.memory is not None else ", memory unknown to the orchestrator"
    return f"{machine.gpus} GPU{'s' if machine.gpus > 1 else ''}{memory} ({machine.told_by})"


LAYOUTS = {"pad": "one example a row, padded or cut to", "stream": "one stream cut into rows of",
           "whole": "examples packed whole into rows of"}


def _echo_data_line(loaded, phases, data: dict) -> None:
    """The data's line, the disk's and the checkpoints' write rate; ScheduleError (exit 2) after
    them where ``run`` would refuse the disk."""
    from orchestrator.errors import ScheduleError
    from orchestrator.space import data_cache_bytes, describe, disk_need, file_system_of, shortfall, write_rate

    st, train = data["stats"], data["stats"]["train"]
    click.echo(f"data: {train['examples']} examples, {train['rows']} rows of {st['seq_len']} tokens "
               f"({st['layout']}), {train['target_tokens']} target tokens, {train['truncated']} truncated "
               "(orchestrator data shows more)")
    for src in st["sources"] if len(st["sources"]) > 1 or st["validation"] else ():
        click.echo(f"  {_source_line(src)}")
    if loaded.schedule.schedule.epochs is not None:
        click.echo(f"schedule: epochs = {loaded.schedule.schedule.epochs:g} of {train['rows']} rows at data.batch_size "
                   f"{loaded.schedule.data.batch_size}: total_steps = {loaded.total_steps}")
    splits = [{**split, "seq_len": st["seq_len"]} for split in (train, st["validation"]) if split]
    need = disk_need(loaded, phases, data_cache_bytes(splits))
    if need is not None:
        click.echo(describe(need, file_system_of(loaded.output_dir)))
    if (rate := write_rate(loaded, phases)) is not None:
        click.echo(rate)
    _warn_without_targets(st)
    if need is not None and (why := shortfall(loaded, need)) is not None:
        raise ScheduleError(why)


def _warn_without_targets(stats: dict) -> None:
    """A warning where training rows carry no target token (they train nothing and take their share
    of a step's batch), with the counts, per source where a source's examples carry none."""
    train = stats["train"]
    if not train.get("rows_without_targets"):
        return
    per_source = [f"{s['key']}: {s['without_targets']:,} of {s['examples']:,} examples"
                  for s in stats["sources"] if s.get("without_targets")]
    click.echo(f"orchestrator: warning: {train['rows_without_targets']:,} of {train['rows']:,} training rows carry no "
               f"target token (nothing to learn: their targets cut by data.seq_len = {stats['seq_len']}, or none "
               "rendered)" + (f"; {'; '.join(per_source)}" if per_source else ""), err=True)


def _source_line(src: dict) -> str:
    """One data file as ``data`` and ``plan`` name it: records, held out, drawn, its chat template
    and how its assistant turns were marked (``launch.data.chat``)."""
    parts = [f"{src['records']} records"] + [f"{src['held_out']} held out"] * bool(src["held_out"])
    if src["key"] != "data.validation_path":
        parts.append(f"weight {src['weight']:g}: {src['examples']} examples an epoch")
    if src["template"]:
        parts.append(f"chat template {src['template']}")
    if src["marking"]:
        parts.append(f"assistant turns marked by {' and '.join(src['marking'])}")
    return f"{src['key']}: {src['path']} ({src['format']}): {', '.join(parts)}"


@main.command()
@schedule_arg
@output_dir_option
@click.option("--show", type=click.IntRange(min=1), metavar="N", help="Also print the first N training rows, in the run's order.")
@click.option("--json", "as_json", is_flag=True,
              help="JSON: with --show, a list of the rows ({text, target, input_ids, target_ids}); else the statistics.")
@set_option
def data(schedule: Path, output_dir: Path | None, show: int | None, as_json: bool, overrides: tuple[str, ...]) -> None:
    """The training data of SCHEDULE as the run will see it: statistics and, with --show N, rows
    with their decoded input and the tokens that carry loss. Writes nothing."""
    import json

    from orchestrator.datastep import check_data
    from orchestrator.validate import load_schedule

    out = check_data(load_schedule(schedule, output_dir=output_dir, overrides=overrides), show or 0)
    st = out["stats"]
    if as_json:
        if show:  # one row a line
            click.echo("[\n" + ",\n".join(json.dumps(r) for r in out["rows"]) + "\n]")
        else:
            click.echo(json.dumps({k: st[k] for k in ("train", "validation", "sources", "validation_files")}, indent=1))
        return
    for src in st["sources"] + st["validation_files"]:
        click.echo(_source_line(src))
    for name, split in (("train", st["train"]), ("validation", st["validation"])):
        if split is None:
            continue
        click.echo(f"{name}: {LAYOUTS[st['layout']]} {st['seq_len']} tokens")
        for label, key in (("examples", "examples"), ("tokens", "tokens"), ("target tokens", "target_tokens"),
                           ("truncated examples", "truncated"), ("rows", "rows"), ("padding tokens", "padding_tokens"),
                           ("dropped tokens", "dropped_tokens"), ("rows without targets", "rows_without_targets")):
            click.echo(f"  {label:<21} {split[key]:>12,}")
    _warn_without_targets(st)
    for i, row in enumerate(out["rows"]):
        text = row["text"] if row["text"] is not None else " ".join(map(str, row["input_ids"]))
        target = row["target"] if row["target"] is not None else " ".join(map(str, row["target_ids"]))
        click.echo(f"\n--- row {i} ({len(row['input_ids'])} tokens, {len(row['target_ids'])} targets)\n{text}"
                   f"\n--- its targets\n{target}")


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
def status(run_dir: Path) -> None:
    """Where a run stands: state, phase, step, last checkpoint, the journal's last events."""
    from orchestrator.display import print_status

    print_status(run_dir)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="The PNG to write (default RUN_DIR/report.png).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the phase rows (steps, layers, status, records, switch overhead) as JSON; draw nothing.")
def report(run_dir: Path, out: Path | None, as_json: bool) -> None:
    """Plot RUN_DIR: loss per step with its phases, memory per phase, overhead per switch."""
    import json

    from orchestrator.report import history_json, write_report

    if as_json and out is not None:
        raise click.UsageError("--out draws the report, --json prints it: give one")
    if as_json:
        click.echo(json.dumps(history_json(run_dir), indent=2))
        return
    click.echo(f"report written: {write_report(run_dir, out)}")
