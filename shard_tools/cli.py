"""The ``shard-tools`` command: inspect, verify, diff, export, outliers. Domain errors become exit codes only here.

    shard-tools inspect runs/tiny
    shard-tools verify runs/tiny
    shard-tools diff runs/tiny/checkpoints/step-00000010 runs/tiny/checkpoints/step-00000030
    shard-tools export runs/tiny --out exported/tiny
    shard-tools outliers models/llama train.jsonl

inspect and verify never import torch, so they answer at once; diff, export and outliers import it when they run.
"""

from __future__ import annotations

import errno
import json
import sys
import time
from pathlib import Path

import click

from shard_tools.errors import CheckpointError, InputError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            _fail(str(e), 2)
        except CheckpointError as e:
            _fail(str(e), 1)
        except OSError as e:
            # A name longer than the file system allows is one the user gave: bad input.
            _fail(f"{e.filename}: {e.strerror}" if e.filename else str(e.strerror or e),
                  2 if e.errno == errno.ENAMETOOLONG else 1)


def _fail(message: str, code: int) -> None:
    click.echo(f"shard-tools: {message}", err=True)
    sys.exit(code)


def _warn(message: str) -> None:
    click.echo(f"shard-tools: warning: {message}", err=True)


def _console():
    from rich.console import Console

    # Piped output gets a wide console so that long tensor names are not wrapped mid-name.
    return Console(width=None if sys.stdout.isatty() else 200)


def _quiet_transformers() -> None:
    """Loading the base model would draw a progress bar on stderr for every command."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def _print_json(report: dict) -> None:
    click.echo(json.dumps(report, indent=2))


@click.group(cls=_Group)
def main() -> None:
    """relayer's checkpoint tools: inspect, verify, diff and export runs and checkpoints."""


path_arg = click.argument("path", type=click.Path(path_type=Path))
json_opt = click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")


@main.command()
@path_arg
@json_opt
def inspect(path: Path, as_json: bool) -> None:
    """A run's phase table, or one checkpoint's tensors, steps and versions."""
    from shard_tools.inspect import inspect_path, render

    report = inspect_path(path)
    if as_json:
        _print_json(report)
    else:
        render(report, _console())


@main.command()
@path_arg
def verify(path: Path) -> None:
    """Completeness and checksums of one checkpoint or of every checkpoint of a run; exit 1 on any fault."""
    from shard_tools.inspect import human_bytes
    from shard_tools.verify import verify_path

    report = verify_path(path)
    for fault in report.faults:
        click.echo(fault)
    n = len(report.checkpoints)
    if report.faults:
        raise CheckpointError(f"{path}: {len(report.faults)} fault(s) in {n} checkpoint(s)")
    click.echo(f"ok: {path}: {n} checkpoint(s), {report.files} files, {human_bytes(report.bytes)}; "
               f"sizes and sha256 match their manifests" + report.in_training())


@main.command()
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@json_opt
def diff(a: Path, b: Path, as_json: bool) -> None:
    """Per tensor, what changed from A to B (checkpoints, or runs: their newest whole checkpoint)."""
    from shard_tools.diff import diff_paths, render

    _quiet_transformers()
    report = diff_paths(a, b, _warn)
    if as_json:
        _print_json(report)
    else:
        render(report, _console())


@main.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The model directory to write.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Weights' dtype (default: the run's).")
@click.option("--force", is_flag=True, help="Replace an earlier export at --out (never anything else).")
@click.option("--max-shard-size", help="Largest weights file, e.g. 500MB (default 5GB); bigger models are sharded.")
@click.option("--wait-for-go", is_flag=True, hidden=True,
              help="The orchestrator's exporter: prepare (build_ahead), then export only after a line 'go' on stdin.")
@click.option("--base-spec", hidden=True, help="With --wait-for-go: the base model to build ahead, as JSON.")
def export(source: Path, out: Path, dtype: str | None, force: bool, max_shard_size: str | None, wait_for_go: bool,
           base_spec: str | None) -> None:
    """A Hugging Face model directory from a run (its newest whole checkpoint) or a checkpoint."""
    from shard_tools.export import build_ahead, export as export_model

    started = time.perf_counter()
    _quiet_transformers()
    prebuilt = build_ahead(base_spec) if wait_for_go else None
    ready = time.perf_counter()
    if wait_for_go and sys.stdin.readline().strip() != "go":
        return  # the run stopped or failed, or the orchestrator is gone (EOF): nothing is written
    # Ahead: the imports and the base model (before ``export`` itself); waiting: the go that came after them.
    times: dict = {"ahead": round(ready - started, 3), "waiting": round(time.perf_counter() - ready, 3)}
    ckpt = export_model(source, out, dtype=dtype, force=force, max_shard_size=max_shard_size, warn=_warn,
                        prebuilt=prebuilt, times=times)
    click.echo(f"exported {ckpt} to {out}")
    if wait_for_go:
        from shard_tools.manifest import EXPORT_TIMINGS

        click.echo(EXPORT_TIMINGS + json.dumps(times))


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("data", type=click.Path(path_type=Path))
@click.option("--rows", default=32, show_default=True, type=click.IntRange(min=1), help="Calibration rows.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=1), help="Tokens a row, at most.")
@click.option("--threshold", default=5.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="OWL's M: an outlier's score is above this many times its layer's mean.")
def outliers(model_dir: Path, data: Path, rows: int, seq_len: int, threshold: float) -> None:
    """OwLore's layer weights: each body layer's outlier ratio (OWL's), as schedule.layer_weights."""
    from shard_tools.outliers import calibration_rows, load_model, outlier_ratios, weights_line

    _quiet_transformers()
    if not (model_dir / "config.json").is_file():  # before the data is read: bad input names the folder first
        raise InputError(f"{model_dir}: no config.json: expected a Hugging Face model directory")
    ids = calibration_rows(data, model_dir, rows, seq_len)
    model = load_model(model_dir)
    click.echo(f"# shard-tools outliers {model_dir} {data}: {len(ids)} rows, threshold {threshold:g}")
    click.echo(weights_line(outlier_ratios(model, ids, threshold)))
