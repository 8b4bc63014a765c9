"""The ``orchestrator`` command: run, plan, status. Domain errors become exit codes only here."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from orchestrator.errors import RelayerError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except RelayerError as e:
            click.echo(f"orchestrator: {e}", err=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group)
def main() -> None:
    """relayer's control plane: runs LISA-style schedules, one fresh process group per phase."""


schedule_arg = click.argument("schedule", type=click.Path(dir_okay=False, path_type=Path))


@main.command()
@schedule_arg
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), help="Run directory (overrides run.output_dir).")
@click.option("--nproc", type=int, help="Processes for every phase (overrides launch.nproc and per-phase nproc).")
@click.option("--force", is_flag=True, help="Resume even though the schedule changed completed work.")
def run(schedule: Path, output_dir: Path | None, nproc: int | None, force: bool) -> None:
    """Run every phase of SCHEDULE; resume from the newest valid checkpoint if the run has progress."""
    from orchestrator.display import Display
    from orchestrator.runner import run_schedule
    from orchestrator.schedule import load_schedule

    loaded = load_schedule(schedule, output_dir=output_dir, nproc=nproc)
    display = Display(loaded)
    with display:
        run_schedule(loaded, force=force, on_event=display.event, progress=display.progress)
    click.echo(f"run complete: {loaded.output_dir}")


@main.command()
@schedule_arg
@click.option("--nproc", type=int, help="Processes for every phase.")
def plan(schedule: Path, nproc: int | None) -> None:
    """Print the phase table of SCHEDULE and check the file, without starting anything."""
    from orchestrator.display import print_plan
    from orchestrator.schedule import load_schedule, plan_phases

    loaded = load_schedule(schedule, nproc=nproc)
    print_plan(loaded, plan_phases(loaded))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
def status(run_dir: Path) -> None:
    """Where a run stands: state, phase, step, last checkpoint, the journal's last events."""
    from orchestrator.display import print_status

    print_status(run_dir)
