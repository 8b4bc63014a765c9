"""``orchestrator report``: one PNG of how a run went, from its metrics and its journal.

    orchestrator report runs/tiny                      # writes runs/tiny/report.png
    orchestrator report runs/tiny --out tiny.png

Three panels: the loss against the global step with the phase boundaries and each phase's
layers; the memory each phase recorded (device memory on CUDA, the process's RSS elsewhere); and
the overhead of each switch: the time from the last step of phase k to the first step of phase k+1,
less one ordinary step of phase k+1. matplotlib (the ``report`` extra) is imported only here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import RelayerError, ScheduleError
from orchestrator.journal import JOURNAL, read_journal

REPORT = "report.png"
METRICS = "metrics.jsonl"
MEMORY_STAGES = ("memory_start", "memory_engine", "memory_peak")
# Free memory is the device's headroom, not what the phase used.
NOT_USAGE = {"device_free"}


@dataclass
class PhaseRow:
    index: int
    start_step: int
    end_step: int
    layers: list[int]
    records: dict = field(default_factory=dict)
    """The records of the process that finished the phase; empty while it is not done."""


@dataclass
class RunReport:
    loss: dict[int, float]
    """Global step (steps done) -> mean loss; a step run again after a restart keeps its last value."""
    phases: list[PhaseRow]
    switch_seconds: dict[int, float]
    """Phase k+1 -> overhead of the switch into it, for switches measured in one go."""


def read_metrics(run_dir: Path) -> dict[int, float]:
    loss: dict[int, float] = {}
    path = run_dir / METRICS
    if not path.exists():
        return loss
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
            loss[int(m["step"])] = float(m["loss"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn last line from a killed writer
    return dict(sorted(loss.items()))


def read_run(run_dir: Path) -> RunReport:
    if not (run_dir / JOURNAL).is_file():
        raise ScheduleError(f"{run_dir}: not a relayer run directory (no {JOURNAL})")
    loss = read_metrics(run_dir)
    if not loss:
        raise ScheduleError(f"{run_dir}: no training steps recorded yet ({run_dir / METRICS} is missing or empty)")
    phases: dict[int, PhaseRow] = {}
    switches: dict[int, float] = {}
    # A switch is measured only when phase k+1's finishing process started straight after phase k
    # ended, in the same orchestrator: a resume in between would count the downtime.
    last_done: dict | None = None
    attempt: tuple[dict, dict | None] | None = None
    for e in read_journal(run_dir):
        kind = e["event"]
        if kind in ("run_started", "resumed"):
            last_done = None
        elif kind == "phase_started":
            row = phases.setdefault(e["phase"], PhaseRow(e["phase"], e["start_step"], e["end_step"], e["layers"]))
            row.start_step = min(row.start_step, e["start_step"])
            attempt = (e, last_done)
            last_done = None
        elif kind == "phase_done":
            rec = e.get("records") or {}
            phases.setdefault(e["phase"], PhaseRow(e["phase"], e["step"], e["step"], e["layers"])).records = rec
            overhead = _switch_overhead(*attempt, e) if attempt is not None else None
            if overhead is not None:
                switches[e["phase"]] = overhead
            last_done, attempt = e, None
    return RunReport(loss=loss, phases=[phases[i] for i in sorted(phases)], switch_seconds=switches)


def _switch_overhead(started: dict, before: dict | None, done: dict) -> float | None:
    """Seconds the switch into ``done``'s phase cost, if its process started right as ``before`` ended it."""
    if before is None or before["phase"] != done["phase"] - 1 or started["start_step"] != before["step"]:
        return None
    prev, rec = before.get("records") or {}, done.get("records") or {}
    times = (prev.get("t_last_step_end"), rec.get("t_first_step_end"), rec.get("step_seconds_median"))
    if not all(isinstance(t, int | float) for t in times):
        return None
    last, first, median = times
    return first - last - median


def memory_series(phases: list[PhaseRow]) -> dict[str, dict[int, float]]:
    """Label ("engine rss", "peak", ...) -> phase -> bytes, for whatever the records hold."""
    series: dict[str, dict[int, float]] = {}
    for row in phases:
        for stage in MEMORY_STAGES:
            value = row.records.get(stage)
            name = stage.removeprefix("memory_")
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for key, v in items:
                if key not in NOT_USAGE and isinstance(v, int | float):
                    series.setdefault(name if key is None else f"{name} {key}", {})[row.index] = float(v)
    return series


def _layers_label(layers: list[int]) -> str:
    return "L" + ",".join(map(str, layers))


def plot(report: RunReport, out: Path, title: str) -> None:
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise RelayerError("orchestrator report needs matplotlib: pip install 'relayer[report]'") from None

    fig = Figure(figsize=(11, 11), layout="constrained")
    ax_loss, ax_mem, ax_switch = fig.subplots(3, 1, height_ratios=[2, 1, 1])
    fig.suptitle(title)

    steps, losses = list(report.loss), list(report.loss.values())
    ax_loss.plot(steps, losses, color="tab:blue", linewidth=1.2, marker="." if len(steps) <= 100 else None)
    ax_loss.set_xlabel("global step")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    many = len(report.phases) > 12
    for row in report.phases:
        if row.start_step > 0:
            # Metrics count steps done: phase k's last is end_step, phase k+1's first end_step + 1.
            ax_loss.axvline(row.start_step + 0.5, color="tab:gray", linestyle="--", linewidth=0.8)
        ax_loss.text((row.start_step + row.end_step + 1) / 2, 0.98, _layers_label(row.layers),
                     transform=ax_loss.get_xaxis_transform(), ha="center", va="top",
                     fontsize=7 if many else 9, rotation=90 if many else 0, color="tab:gray")

    series = memory_series(report.phases)
    peak = max((v for s in series.values() for v in s.values()), default=0.0)
    scale, unit = (2**30, "GiB") if peak >= 2**30 else (2**20, "MiB")
    for label, by_phase in series.items():
        ax_mem.plot(list(by_phase), [v / scale for v in by_phase.values()], marker="o", label=label)
    ax_mem.set_xlabel("phase")
    ax_mem.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_mem.set_ylabel(f"memory ({unit})")
    ax_mem.set_title("memory per phase (device memory on CUDA, process RSS elsewhere)", fontsize=10)
    ax_mem.grid(alpha=0.3)
    if series:
        ax_mem.legend(fontsize=8, ncols=3)
    else:
        ax_mem.text(0.5, 0.5, "no phase has finished yet", transform=ax_mem.transAxes, ha="center")

    switches = report.switch_seconds
    ax_switch.bar([f"{k - 1}→{k}" for k in switches], list(switches.values()), color="tab:orange")
    ax_switch.set_xlabel("switch (phase k → k+1)")
    ax_switch.set_ylabel("seconds")
    ax_switch.set_title("switch overhead: first step of k+1 ends − last step of k ends − median step of k+1",
                        fontsize=10)
    ax_switch.grid(alpha=0.3, axis="y")
    if not switches:
        ax_switch.text(0.5, 0.5, "no switch measured in one go", transform=ax_switch.transAxes, ha="center")
    if len(switches) > 12:
        ax_switch.tick_params(axis="x", labelrotation=90, labelsize=7)

    tmp = out.with_name(f".tmp-{out.name}.{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Reads the run, plots it, writes the PNG atomically; returns where."""
    report = read_run(run_dir)
    out = out or run_dir / REPORT
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(report, out, f"{run_dir.resolve().name}: {max(report.loss)} steps, {len(report.phases)} phases")
    return out
