"""What a person sees: the plan table, the run's progress, its status. Plain lines off a terminal."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table
from rich.text import Text

from launch.contract import ops

from orchestrator.errors import ScheduleError
from orchestrator.estimate import PlanEstimate
from orchestrator.groups import Group
from orchestrator.handover import Switch
from orchestrator.nodes import plan_lines
from orchestrator.pace import Pace, clock
from orchestrator.plan import plan_phases
from orchestrator.rundir import lock_held
from orchestrator.schedule import LoadedSchedule, Phase
from orchestrator.supervisor import Observer, State
from shard_tools.history import JOURNAL, read_journal
from shard_tools.sizes import format_bytes

# Off a terminal, lines are logs: never wrap them (rich would at 80 columns).
console = Console(stderr=True, soft_wrap=True)


def print_plan(loaded: LoadedSchedule, phases: list[Phase], switches: list[Switch],
               estimate: PlanEstimate | None = None, device_memory: int | None = None,
               here: tuple[str, list[Switch]] | None = None) -> None:
    """The phase table (with ``estimate``, each phase's memory per process), the run's settings,
    and how its switches hand over: on this machine (``here``: what it offers, and its switches),
    then ``switches`` on a GPU (of ``device_memory``)."""
    s = loaded.schedule
    table = Table(title=f"{loaded.source.name}: {len(phases)} phases, {phases[-1].end_step} steps, "
                        f"model of {loaded.num_layers} layers")
    memory_cols = ("weights", "optimizer", "gradients", "activations", "total") if estimate else ()
    for col in ("phase", "steps", "global steps", "layers", "processes", *memory_cols):
        table.add_column(col, justify="right" if col != "layers" else "left")
    for i, p in enumerate(phases):
        cells = [str(p.index), str(p.steps), f"{p.start_step}-{p.end_step - 1}", _layers_cell(p), str(p.nproc)]
        style = None
        if estimate:
            m = estimate.phases[i]
            cells += [format_bytes(b) for b in (m.weights, m.optimizer, m.gradients, m.activations, m.total)]
            style = "red" if device_memory is not None and m.total > device_memory else None
        table.add_row(*cells, style=style)
    # Piped, the table keeps one line a phase (rich would wrap it at 80 columns) for scripts to read,
    # however many module units a phase names.
    widest = max(len(_layers_cell(p)) for p in phases)
    out = Console(width=None if sys.stdout.isatty() else 200 + widest)
    out.print(table)
    chosen = "" if "zero_stage" in (loaded.raw.get("deepspeed") or {}) else (
        " (deepspeed.zero_stage unset: 0 on one process, else 2)")
    out.print(f"ZeRO stage {s.deepspeed.zero_stage}{chosen}, {s.model.dtype}, launcher {s.launch.launcher}, "
              f"batch {s.data.batch_size} (micro {s.data.micro_batch_size}), run directory {loaded.output_dir}")
    out.print(_choice_line(s), markup=False, highlight=False)
    for line in [*_switch_sections(loaded, switches, device_memory, here), *plan_lines(s.launch)]:
        out.print(line, markup=False, highlight=False)
    if estimate:
        device = f", device {format_bytes(device_memory)}" if device_memory is not None else ""
        ckpt = "with" if s.model.gradient_checkpointing else "without"
        out.print(f"estimated device memory per process: {estimate.count.total:,} parameters, activations {ckpt} "
                  f"gradient checkpointing and the logits; ZeRO's reduce bucket counted; the CUDA context not counted{device}")
        for line in filter(None, (largest_phase(phases, estimate), holder_line(estimate))):
            out.print(line, markup=False, highlight=False)


def _layers_cell(p: Phase) -> str:
    """A phase's layers; drawn as the run goes (schedule.layer_weights = "grad_norm"): how many;
    module units: each layer with its units ("3: self_attn.q_proj, mlp.up_proj")."""
    if p.drawn_later:
        return "units by gradient norm" if p.modules else f"{len(p.layers)} by gradient norm"
    if p.modules:
        return "; ".join(f"{layer}: " + ", ".join(u.partition(".")[2] for u in p.modules
                                                   if u.partition(".")[0] == str(layer)) for layer in p.layers)
    return ", ".join(map(str, p.layers))


def holder_line(estimate: PlanEstimate) -> str | None:
    """Where the phases map one copy of the model per GPU (``launch.resident``), what it holds."""
    if not estimate.resident:
        return None
    return (f"the model's weights: {format_bytes(estimate.resident)} per GPU with the holder's process, one copy "
            f"for the whole run that every phase maps (launch.resident); a phase's weights above are what it trains")


def largest_phase(phases: list[Phase], estimate: PlanEstimate) -> str:
    """The phase of the most estimated memory per process, in a line."""
    big = max(range(len(phases)), key=lambda i: estimate.phases[i].total)
    return (f"largest phase: {phases[big].index} (layers {_layers_cell(phases[big])}), "
            f"estimated {format_bytes(estimate.phases[big].total)} per process")


def _choice_line(s) -> str:
    """How the phases' layers were chosen and what their optimizer state does at a switch."""
    sc, warmup = s.schedule, s.lr_schedule.phase_warmup_steps
    how = "explicit phases" if sc.strategy is None else f"strategy {sc.strategy}"
    if sc.by_importance:
        how += (f" by gradient norm ({'per unit' if sc.strategy == 'misa' else 'IST'}): phase i draws by the norms "
                f"phases 0 .. i - {sc.importance_lag} measured at their last steps (the first {sc.importance_lag} alike)")
    elif sc.layer_weights not in (None, "uniform"):
        how += " weighted " + "/".join(f"{w:g}" for w in sc.layer_weights)
    if sc.window:
        how += f", no layer twice within {sc.window} phases"
    if sc.strategy == "misa":
        how += (f" (MISA): module units drawn to {sc.module_budget:g} of the body's parameters a phase, the rest of "
                "their layers frozen")
    elif sc.by_modules:
        how += " of module units (MISA), the rest of their layers frozen"
    state = {"reset": "the body's new each phase, the head's carried",
             "drop-all": "the body's and the head's new each phase",
             "keep": "each layer's kept in the checkpoint from its last visit (new on its first), as LMFlow's "
                     "and axolotl's LISA callbacks; the head's carried"}[sc.optimizer_state]
    return f"layers: {how}; optimizer state ({sc.optimizer_state}): {state}" + \
        (f"; lr warm-up of {warmup} steps after each switch" if warmup else "")


def _switch_sections(loaded: LoadedSchedule, switches: list[Switch], device_memory: int | None,
                     here: tuple[str, list[Switch]] | None) -> list[str]:
    """How the switches go on this machine (``here``), then on a GPU where that differs; on a
    machine without one, only with --device-memory (a GPU's overlap peak is mostly its processes'
    CUDA contexts, 2.6 GB each, a puzzle beside a CPU run of a small model)."""
    sections = [] if here is None else [(f"on this machine ({here[0]})", here[1], loaded.schedule.launch.handover == "on")]
    if here is not None and here[0].startswith("no GPU") and device_memory is None and switches != here[1]:
        return [line for title, listed, host in sections for line in [f"{title}:", *(f"  {x}" for x in
                switch_lines(listed, host=host))]] + ["on a GPU: --device-memory SIZE shows how each switch goes there"]
    if here is None or switches != here[1]:
        size = f" of {format_bytes(device_memory)} (--device-memory)" if device_memory is not None else \
            " (--device-memory SIZE checks each overlap against it)"
        sections.append((f"on a GPU{size}", switches, False))
    return [line for title, listed, host in sections
            for line in [f"{title}:", *(f"  {x}" for x in switch_lines(listed, host=host))]]


def switch_lines(switches: list[Switch], *, host: bool = False) -> list[str]:
    """A line per outcome: the switches that hand over on the device at one overlap peak, or that
    go through the checkpoint for one reason; in the order of their first switch."""
    groups: dict[tuple[str | None, int | None, bool], list[int]] = {}
    for sw in switches:
        groups.setdefault((sw.reason, sw.peak if sw.reason is None else None, sw.host), []).append(sw.after)
    lines = []
    for (reason, peak, through_host), after in groups.items():
        where = f"switch{'es' if len(after) > 1 else ''} after phase{'s' if len(after) > 1 else ''} {_indices(after)}"
        if reason is not None:
            lines.append(f"{where}: through {'host memory' if through_host else 'the checkpoint'}: {reason}")
            continue
        how = "on the device (through a file without a GPU)" if host else "on the device"
        size = f"overlap peak {format_bytes(peak)} per device" if peak is not None else "overlap peak not estimated"
        lines.append(f"{where}: hand{'' if len(after) > 1 else 's'} over {how}, {size}")
    return lines


def _indices(numbers: list[int], most: int = 10) -> str:
    """Ascending numbers as runs (0-3, 5, 7-9), at most ``most`` of them named."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    named = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:most])
    rest = sum(b - a + 1 for a, b in runs[most:])
    return named + (f" and {rest:,} more" if rest else "")


class Display(Observer):
    """Journal events as lines, and one progress bar over the run's global steps; follows each
    phase as the supervisor's observer."""

    # Preparing: what a pre-warmed phase did before its turn, not worth a line when it starts.
    PREPARATION = ("starting the process group", "loading the model", "preparing data", "warming up")
    WIDE = 110
    """Columns from which the bar and the time elapsed fit beside the counter and the numbers."""
    QUIET = 60.0
    """Seconds without a line before a start says it still waits, and for what."""

    def __init__(self, loaded: LoadedSchedule, machine_has_gpu: bool | None = None):
        phases = plan_phases(loaded)
        self.total = phases[-1].end_step
        self.pace = Pace(phases)
        self.live = console.is_terminal
        # The ETA is the pace's (it counts the switches ahead); rich's own swings with every switch.
        # The step counter comes first and is never cut: the rest, cut at its end where it does not fit.
        rest = TextColumn("{task.description}  {task.fields[info]}", table_column=Column(no_wrap=True, overflow="ellipsis"))
        wide = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        self._progress = Progress(MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=2 * len(str(self.total)) + 1)),
                                  *(wide if console.width >= self.WIDE else [rest]), console=console,
                                  disable=not self.live)
        self._task = self._progress.add_task("steps", total=self.total, info="")
        self._last_plain = self._last_said = self._started = time.time()
        self._group: Group | None = None
        """The phase running now."""
        self._waiting = ""
        """What the phase running now waits for before its first step; "" once it trains."""
        gpu = machine_has_gpu if machine_has_gpu is not None else _has_gpu()
        self._op_ahead = not gpu and ops.built() is None
        """DeepSpeed's CPU comm op is built for these Python, torch and DeepSpeed versions by this
        run's first process (minutes)."""

    def say(self, text: str) -> None:
        """A line above the bar; off a terminal, a log line with the time."""
        self._last_said = time.time()
        if self.live:
            self._progress.console.print(text, highlight=False)
        else:
            console.print(f"{time.strftime('%H:%M:%S')} {text}", highlight=False)

    def _wait_for(self, what: str) -> None:
        """What the bar, still before the phase's first step, says it waits for."""
        self._waiting = what
        self._progress.update(self._task, info=f"waiting for: {what}" if what else "")

    def on_poll(self) -> None:
        """A start that says nothing for ``QUIET`` seconds says what it still waits for."""
        if not self._waiting or time.time() - self._last_said < self.QUIET:
            return
        news = self._op_news()
        self.say(news or f"phase {self._group.work.phase.index}: still waiting for {self._waiting} "
                         f"({clock(time.time() - self._started)} so far)" + (f"; {OP_BUILD}" if self._op_ahead else ""))

    def _op_news(self) -> str | None:
        """Once, where this run built DeepSpeed's CPU comm op: how long that took."""
        record = ops.built() if self._op_ahead else None
        if record is None:
            return None
        self._op_ahead = False
        return (f"DeepSpeed's CPU comm op built in {record.get('seconds', 0):.0f} s, once for these Python, torch "
                f"and DeepSpeed versions ({ops.extensions_dir()}); later runs load it")

    def __enter__(self) -> Display:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def event(self, e: dict) -> None:
        kind = e["event"]
        text = {
            "run_started": lambda: f"run started: {e['phases']} phases, {e['total_steps']} steps",
            "resumed": lambda: f"complete at step {e['step']}: {e['final']} is its model; its checkpoints are gone, "
                               "nothing is trained again" if e.get("final") else
                               f"resuming at step {e['step']}" + (f" from {e['checkpoint']}" if e.get("checkpoint") else ""),
            "phase_started": lambda: f"phase {e['phase']} started: steps {e['start_step']}-{e['end_step'] - 1}, "
                                     f"layers {e['layers']}" + (f" ({len(e['modules'])} module units: "
                                     f"{', '.join(e['modules'])})" if e.get("modules") else "") +
                                     f", {e['nproc']} process(es)",
            "phase_done": lambda: None if "checkpoint_at" in e else f"phase {e['phase']} done at step {e['step']} " + (
                "(found at the resume: its checkpoint is whole, the journal did not say so)"
                if e.get("recovered") else f"in {e['seconds']:.1f} s"),
            "phase_trained": lambda: f"phase {e['phase']} done at step {e['step']}; its layers go on to the next "
                                     "checkpoint (checkpoint.every_seconds)",
            "checkpoint_skipped": lambda: f"skipping damaged checkpoint: {e['fault']}",
            # A phase's prepared files (.tmp-prepared.*) go whenever its phase does not run: no news.
            "stray_removed": lambda: None if ".tmp-prepared." in e["path"] else
                                     f"removed an unfinished file of a writer that was stopped: {e['path']}",
            "killed": lambda: f"stopped leftover processes {e['pids']}",
            "stop_requested": lambda: f"stopping (signal {e['signal']}): phase {e['phase']} finishes its step and "
                                      "writes a checkpoint; a second Ctrl-C ends the run at once, without it",
            "stop_repeated": lambda: f"still stopping (signal {e['signal']}): waiting for {e['waiting_for']}; "
                                     "Ctrl-C ends the run at once",
            "run_done": lambda: f"all {e['step']} steps done",
            "checkpoints_set_aside": lambda: f"resuming from {e['resume_from']}: moved {', '.join(e['checkpoints'])} "
                                             f"aside to {e['to']}",
            "final_model_started": lambda: f"writing the final model to {e['path']}",
            "final_model_written": lambda: f"final model written: {e['path']}",
        }.get(kind)
        line = text() if text else None
        if line:
            self.say(line)

    def on_state(self, state: State, group: Group) -> None:
        if state is not State.STARTING:
            return
        self._group, self._started = group, time.time()
        phase = group.work.phase
        if (news := self._op_news()) is not None:
            self.say(news)
        if not group.prewarmed:
            self.say(f"phase {phase.index}: starting its processes (importing torch and DeepSpeed)"
                     + (f"; {OP_BUILD}" if self._op_ahead else ""))
        self._progress.update(self._task, completed=group.work.start_step,
                              description=f"phase {phase.index} layers {list(phase.layers)}")
        self._wait_for("the go" if group.prewarmed else "its processes to start")

    def on_stage(self, stage: dict) -> None:
        if (news := self._op_news()) is not None:
            self.say(news)
        if not (self._group.prewarmed and stage["stage"] in self.PREPARATION):
            self.say(f"phase {self._group.work.phase.index}: {stage['stage']}")
        self._wait_for(stage["stage"])

    def on_metric(self, m: dict) -> None:
        if "eval_loss" in m:
            sources = ", ".join(f"{k.removeprefix('eval_loss/')} {v:.4f}" for k, v in m.items()
                                if k.startswith("eval_loss/"))
            self.say(f"step {m['step']}: eval loss {m['eval_loss']:.4f}" + (f" ({sources})" if sources else ""))
            return
        phase, start_step = self._group.work.phase, self._group.work.start_step
        self._waiting = ""
        self.pace.add(m)
        tps = self.pace.tokens_per_s
        info = (f"loss {m['loss']:.4f}  lr {m['lr']:.2e}  "
                f"{f'{tps:.0f} tok/s' if tps else 'tok/s after a steady step'}  "
                f"ETA {clock(self.pace.eta(m['step']))}")
        self._progress.update(self._task, completed=m["step"], info=info)
        if not self.live and (time.time() - self._last_plain > 5 or m["step"] in (phase.end_step, start_step + 1)):
            self.say(f"step {m['step']}/{self.total}  phase {m['phase']}  layers {m['layers']}  {info}")
            self._last_plain = time.time()


OP_BUILD = ("first DeepSpeed's CPU comm op is built for these Python, torch and DeepSpeed versions (once: a few "
            "minutes on a busy 2-core machine; the next runs load it)")


def _has_gpu() -> bool:
    from orchestrator.machine import this_machine

    return this_machine().gpus > 0


def run_state(run_dir: Path, events: list[dict]) -> str:
    if lock_held(run_dir):
        return "running"
    last = next((e for e in reversed(events) if e["event"] in
                 ("run_done", "preempted", "phase_failed", "phase_stalled", "run_failed", "phase_started", "run_started",
                  "resumed")), {"event": None})
    if last["event"] in ("phase_failed", "phase_stalled", "run_failed"):
        where = f"phase {last['phase']}: " if last["event"] != "run_failed" else ""
        how = "stalled" if last["event"] == "phase_stalled" else "failed"
        return f"{how} ({where}{last.get('reason') or 'no reason recorded'})"
    return {"run_done": "done", "preempted": "preempted", None: "not started"}.get(
        last["event"], "stopped (the orchestrator was killed; run again to resume)")


def print_status(run_dir: Path) -> None:
    from shard_tools.store import Checkpoints

    if not (run_dir / JOURNAL).exists():
        raise ScheduleError(f"{run_dir}: not a relayer run directory (no {JOURNAL})")
    events = read_journal(run_dir)
    ckpt, manifest, skipped = Checkpoints(run_dir).newest_whole(checksums=False)
    out = Console(width=None if sys.stdout.isatty() else 200, markup=False)
    out.print(Text.assemble((str(run_dir), "bold"), f": {run_state(run_dir, events)}"), soft_wrap=True)  # one line
    started = [e for e in events if e["event"] == "phase_started"]
    if started:
        e = started[-1]
        out.print(f"phase {e['phase']} (steps {e['start_step']}-{e['end_step'] - 1}, layers {e['layers']})")
    if manifest:
        out.print(f"last checkpoint: {ckpt.name} (step {manifest.global_step}, phase {manifest.phase}, "
                  f"{'phase end' if manifest.phase_complete else 'mid-phase'}, head step {manifest.head_step})")
    for fault in skipped:
        out.print(Text.assemble(("damaged:", "red"), f" {fault}"))
    table = Table(title="last events")
    table.add_column("time")
    table.add_column("event")
    table.add_column("details", overflow="fold")  # whole: a failure's reason is what status is read for
    for e in events[-8:]:
        details = {k: v for k, v in e.items() if k not in ("time", "event", "records")}
        table.add_row(time.strftime("%H:%M:%S", time.localtime(e["time"])), e["event"], json.dumps(details))
    out.print(table)
