"""``orchestrator report``: one PNG of how a run went, from its metrics and its journal.

    orchestrator report runs/tiny                      # writes runs/tiny/report.png
    orchestrator report runs/tiny --out tiny.png
    orchestrator report runs/tiny --json               # the phase rows as JSON; writes nothing

Three panels: the loss against the global step (and the eval loss, and the lr on an axis of its
own) with the phase boundaries and each phase's layers; the memory each phase recorded (device
memory on CUDA, the process's RSS elsewhere); and the overhead of each switch as
``shard_tools.history`` defines it: the time from the last step of phase k to the first step of
phase k+1, less one ordinary step of phase k+1, within one go of the orchestrator. matplotlib
(the ``report`` extra) is imported only here.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launch.contract.files import RunDir
from orchestrator.errors import RelayerError, ScheduleError
from orchestrator.journal import open_run_file
from shard_tools.files import kind_of, open_regular, write_atomic
from shard_tools.history import PhaseRow, read_history, read_journal

REPORT = "report.png"
MARK = "relayer orchestrator report"
"""The PNG's Software text: what tells a report this command wrote from any other file at --out."""
_PNG = b"\x89PNG\r\n\x1a\n"
MEMORY_STAGES = ("memory_start", "memory_engine", "memory_peak")
# Free memory is the device's headroom, not what the phase used.
NOT_USAGE = {"device_free"}


@dataclass
class RunReport:
    loss: dict[int, float]
    """Global step (steps done) -> mean loss; a step run again after a restart keeps its last value."""
    phases: list[PhaseRow]
    eval_loss: dict[int, float] = field(default_factory=dict)
    """Global step -> mean loss over the validation data, where it was evaluated."""
    lr: dict[int, float] = field(default_factory=dict)
    """Global step -> the lr its step trained at."""
    stops: list[int] = field(default_factory=list)
    """Steps at which the run was stopped (its ``preempted`` events: the checkpoint kept)."""
    resumes: list[int] = field(default_factory=list)
    """Steps from which it was resumed (its ``resumed`` events)."""

    @property
    def switch_seconds(self) -> dict[int, float]:
        """Phase k+1 -> overhead of the switch into it, for switches measured in one go."""
        return {p.index: p.switch_seconds for p in self.phases if p.switch_seconds is not None}


def read_metrics(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """Global step -> the value of ``key`` (loss, eval_loss, lr) of every line that is a step's record
    with one; any other line (torn by a killed writer, damaged, not UTF-8, absurd) is skipped. A
    metrics.jsonl that is no file is ScheduleError."""
    loss: dict[int, float] = {}
    with open_run_file(RunDir(run_dir).metrics, "the run's metrics") as f:
        data = f.read() if f is not None else b""
    for line in data.decode(errors="replace").splitlines():
        try:
            m = json.loads(line)
            step, value = m["step"], m[key]
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**53 \
                and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            loss[step] = float(value)
    return dict(sorted(loss.items()))


def read_run(run_dir: Path) -> RunReport:
    phases = read_history(run_dir).phases
    loss = read_metrics(run_dir)
    if not loss:
        raise ScheduleError(f"{run_dir}: no training steps recorded yet ({RunDir(run_dir).metrics} is missing or empty)")
    events = read_journal(run_dir)
    return RunReport(loss=loss, phases=phases, eval_loss=read_metrics(run_dir, "eval_loss"),
                     lr=read_metrics(run_dir, "lr"), stops=_steps_of(events, "preempted"),
                     resumes=_steps_of(events, "resumed"))


def _steps_of(events: list[dict[str, Any]], kind: str) -> list[int]:
    return [e["step"] for e in events if e.get("event") == kind and isinstance(e.get("step"), int)]


def history_json(run_dir: Path) -> dict[str, Any]:
    """``orchestrator report --json``: the run's phase rows, switch overheads included, as plain data."""
    history = read_history(run_dir)
    return {"path": str(run_dir), "events": history.events, "last_event": history.last_event,
            "phases": [asdict(p) for p in history.phases]}


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
    _plot_loss(ax_loss, report)
    _plot_memory(ax_mem, report)
    ax_mem.xaxis.set_major_locator(MaxNLocator(integer=True))
    _plot_switches(ax_switch, report)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, metadata={"Software": MARK})
    # Any file's mode (0666 less the umask), as savefig gives; not fsynced: a report is redrawn at will.
    write_atomic(out, png.getvalue(), mode=0o666, durable=False)


def _plot_loss(ax, report: RunReport) -> None:
    """Loss and eval loss per step, the lr on an axis of its own, with the phases' bounds and layers."""
    _plot_curves(ax, report)
    many = len(report.phases) > 12
    for row in report.phases:
        if row.start_step > 0:
            # Metrics count steps done: phase k's last is end_step, phase k+1's first end_step + 1.
            ax.axvline(row.start_step + 0.5, color="tab:gray", linestyle="--", linewidth=0.8)
        ax.text((row.start_step + row.end_step + 1) / 2, 0.98, _layers_label(row.layers),
                transform=ax.get_xaxis_transform(), ha="center", va="top",
                fontsize=7 if many else 9, rotation=90 if many else 0, color="tab:gray")
    # An interrupted run: where it stopped (the step its checkpoint kept) and where it went on from.
    for steps, colour, style, what in ((report.stops, "tab:red", ":", "stopped at step"),
                                       (report.resumes, "tab:purple", "-.", "resumed from step")):
        for step in steps:
            ax.axvline(step + 0.5, color=colour, linestyle=style, linewidth=1.2, label=f"{what} {step}")

def _plot_curves(ax_loss, report: RunReport) -> None:
    """The loss and the eval loss on one axis, the lr on one of its own (right)."""
    steps = list(report.loss)
    ax_loss.plot(steps, list(report.loss.values()), color="tab:blue", linewidth=1.2, label="loss",
                 marker="." if len(steps) <= 100 else None)
    if report.eval_loss:
        ax_loss.plot(list(report.eval_loss), list(report.eval_loss.values()), color="tab:red", marker="o",
                     linewidth=1.2, label="eval loss")
    ax_loss.set_xlabel("global step")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_lr = ax_loss.twinx()
    ax_lr.plot(list(report.lr), list(report.lr.values()), color="tab:green", linewidth=1.0, linestyle=":", label="lr")
    ax_lr.set_ylabel("lr")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    handles = [h for ax in (ax_loss, ax_lr) for h in ax.get_legend_handles_labels()[0]]
    ax_loss.legend(handles=handles, loc="lower left", fontsize=8)


def _plot_memory(ax, report: RunReport) -> None:
    """Memory per phase, in GiB or MiB as the peak needs."""
    series = memory_series(report.phases)
    peak = max((v for s in series.values() for v in s.values()), default=0.0)
    scale, unit = (2**30, "GiB") if peak >= 2**30 else (2**20, "MiB")
    for label, by_phase in series.items():
        ax.plot(list(by_phase), [v / scale for v in by_phase.values()], marker="o", label=label)
    ax.set_xlabel("phase")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title("memory per phase (device memory on CUDA, process RSS elsewhere)", fontsize=10)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8, ncols=3)
    else:
        ax.text(0.5, 0.5, "no phase has finished yet", transform=ax.transAxes, ha="center")


def _plot_switches(ax, report: RunReport) -> None:
    """The overhead of each switch measured in one go."""
    switches = report.switch_seconds
    ax.bar([f"{k - 1}→{k}" for k in switches], list(switches.values()), color="tab:orange")
    ax.set_xlabel("switch (phase k → k+1)")
    ax.set_ylabel("seconds")
    ax.set_title("switch overhead: first step of k+1 ends − last step of k ends − an ordinary step of k+1 "
                 "(its median, at most its first)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    if not switches:
        ax.text(0.5, 0.5, "no switch measured in one go", transform=ax.transAxes, ha="center")
    if len(switches) > 12:
        ax.tick_params(axis="x", labelrotation=90, labelsize=7)


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Reads the run, plots it, writes the PNG atomically; returns where."""
    check_out(out or run_dir / REPORT, own=out is None)
    report = read_run(run_dir)
    out = out or run_dir / REPORT
    plot(report, out, f"{run_dir.resolve().name}: {max(report.loss)} steps, {len(report.phases)} phases")
    return out


def check_out(out: Path, own: bool) -> None:
    """ScheduleError (exit 2, nothing written) unless ``out`` is new in a folder that exists, or a
    report this command wrote (a PNG whose Software text is ``MARK``; at the run's own report.png,
    ``own``, any PNG: those drawn before the mark). Never a device, FIFO, socket, folder, link, or a
    file of someone else's: the write replaces what is there."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        if not out.parent.is_dir():
            raise ScheduleError(f"--out {out}: {out.parent} is not a directory; report makes no folders") from None
        return
    except OSError as e:
        raise ScheduleError(f"--out {out}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise ScheduleError(f"--out {out}: {kind_of(mode)}; report writes a new file or replaces a report it wrote")
    try:
        fd = open_regular(out, follow_symlinks=False)
        with os.fdopen(fd, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise ScheduleError(f"--out {out}: cannot be read ({e.strerror or e})") from None
    if not head.startswith(_PNG) or not (own or MARK.encode() in head):
        raise ScheduleError(f"--out {out}: a file this command did not write (not a relayer report); report "
                            f"replaces only a report it wrote: give a new name or remove it")
