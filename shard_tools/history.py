"""A run's history replayed from its journal: one row per phase, with the overhead of the switch into it.

The journal's reader and its one replay, pure and torch-free, here where both the control plane
and the format package import them: ``orchestrator report`` plots the rows, ``orchestrator report
--json`` prints them, the runner finds the phases it never journaled done in them, and
``shard-tools inspect RUN_DIR`` shows them beside the checkpoints. The journal's writer is the
orchestrator's (``orchestrator.journal``).

The overhead of the switch into phase k+1 is what changing phases cost the run's wall clock: from
the end of phase k's last step to the end of phase k+1's first step, less one ordinary step of
phase k+1: its median step, or its first step's own time where that was shorter. A first step
slower than the median (a cold one) counts its excess as switch; one faster than the median (the
phases further ahead stay paused until it is done, and a loaded machine makes steps vary) must
not make the switch look shorter than the wait before that step began, let alone negative. It is
measured only within one go of the orchestrator: the processes that finished phase k and phase
k+1 were started by the same go, the latter where phase k ended.
Downtime between two goes (a preemption, a kill, a ``--resume-from``) is no switch: a phase
whose finishing process started after the orchestrator came back has no overhead, and its row
says ``resumed``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shard_tools.errors import CheckpointError, InputError
from shard_tools.files import describe, open_regular, regular_fault

JOURNAL = "journal.jsonl"
"""RUN_DIR/journal.jsonl: every event of the run, one JSON object a line."""

# The fields that readers (status, report, the runner) take from events, with their types; an
# event holding one of another type is not one the orchestrator wrote, and is skipped like a torn line.
FIELD_TYPES: dict[str, type] = {"phase": int, "start_step": int, "end_step": int, "step": int, "layers": list,
                                "nproc": int, "records": dict, "reason": str}
REQUIRED = {"phase_started": ("phase", "start_step", "end_step", "layers"), "phase_done": ("phase", "step", "layers"),
            "resumed": ("step",), "preempted": ("step",), "phase_failed": ("phase",), "phase_stalled": ("phase",)}


ENDED = {"phase_failed": "failed", "phase_stalled": "stalled", "preempted": "preempted"}
"""The events that end a phase short of done, and the status each leaves it in."""


def is_event(record: Any) -> bool:
    """A JSON object as the orchestrator's ``Journal.write`` makes them: an event name, a time,
    fields of the types readers expect."""
    if not (isinstance(record, dict) and isinstance(record.get("event"), str) and _number(record.get("time"))):
        return False
    if any(key not in record for key in REQUIRED.get(record["event"], ())):
        return False
    for key, kind in FIELD_TYPES.items():
        value = record.get(key)
        if value is None and key not in REQUIRED.get(record["event"], ()):
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            return False
        if kind is list and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return False
    return True


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def read_journal(run_dir: Path) -> list[dict[str, Any]]:
    """Every event; what is not one (a torn last line from a writer killed mid-write, a line edited
    or damaged by hand) is skipped."""
    path = Path(run_dir) / JOURNAL
    try:
        fd = open_regular(path)  # a FIFO, a device, a folder or a link loop: a message, never a block
    except FileNotFoundError:
        return []
    except OSError as e:
        raise InputError(f"{path}: {describe(e)}; expected the run's journal") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    events = []
    for line in data.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if is_event(record):
            events.append(record)
    return events


@dataclass
class PhaseRow:
    index: int
    start_step: int
    """The global step the phase began at (its first start, however often it was resumed)."""
    end_step: int
    layers: list[int]
    nproc: int | None = None
    status: str = "started"
    """started, done, failed, stalled or preempted: what the journal says last of the phase."""
    attempts: int = 0
    seconds: float | None = None
    """Wall time of the process group that finished the phase, from its start to its last process gone."""
    switch_seconds: float | None = None
    """Overhead of the switch into this phase (see the module's docstring), when measured."""
    records: dict = field(default_factory=dict)
    """The records of the process that finished the phase; empty while it is not done."""
    resumed: bool = False
    """Its last process group started after the orchestrator resumed the run: the time before is
    downtime, not a switch."""
    grad_norms: dict[int | str, float] | None = None
    """With schedule.layer_weights = "grad_norm": each of its layers' gradient norm at its last step,
    by which later phases were drawn (the journal's last ``grad_norms`` of it)."""


@dataclass
class History:
    phases: list[PhaseRow]
    events: int
    last_event: str | None


def read_history(run_dir: Path) -> History:
    """The phases of the run in ``run_dir``, from its journal; InputError if it has none."""
    path = Path(run_dir) / JOURNAL
    if not path.exists():
        raise InputError(f"{run_dir}: not a relayer run directory (no {JOURNAL})")
    if fault := regular_fault(path):
        raise CheckpointError(f"{path}: {fault}")
    events = read_journal(run_dir)
    return History(phases=replay(events), events=len(events), last_event=events[-1]["event"] if events else None)


def replay(events: list[dict[str, Any]]) -> list[PhaseRow]:
    """Phase rows from journal events (as ``read_journal`` returns them), in phase order."""
    phases: dict[int, PhaseRow] = {}
    # Per phase, its last phase_started with the go of the orchestrator (counted from 1 at each
    # run_started or resumed) that journaled it, and its phase_done. A switch is measured where the
    # process groups on both sides of it were started in the same go; when their phase_done
    # events come does not matter (a handed-over phase's comes after its successor's start, and
    # any phase's only once its checkpoint is durable: ``orchestrator.commit``).
    started: dict[int, tuple[int, dict]] = {}
    done: dict[int, dict] = {}
    go, after_resume = 0, False
    for e in events:
        kind = e["event"]
        if kind in ("run_started", "resumed"):
            go, after_resume = go + 1, kind == "resumed"
        elif kind == "phase_started":
            row = phases.setdefault(e["phase"], PhaseRow(e["phase"], e["start_step"], e["end_step"], e["layers"]))
            row.start_step = min(row.start_step, e["start_step"])
            row.end_step, row.layers, row.nproc = e["end_step"], e["layers"], e.get("nproc")
            row.status, row.attempts, row.resumed = "started", row.attempts + 1, after_resume
            started[e["phase"]], after_resume = (go, e), False
        elif kind == "phase_done":
            row = phases.setdefault(e["phase"], PhaseRow(e["phase"], e["step"], e["step"], e["layers"]))
            row.status, row.end_step, row.records = "done", e["step"], e.get("records") or {}
            row.seconds = _finite(e.get("seconds"))
            done[e["phase"]] = e
            start, prev, before = started.get(e["phase"]), started.get(e["phase"] - 1), done.get(e["phase"] - 1)
            same_go = None not in (start, prev, before) and start[0] == prev[0]
            row.switch_seconds = switch_overhead(start[1], before, e) if same_go else None
        elif kind == "grad_norms" and e.get("phase") in phases:
            phases[e["phase"]].grad_norms = journaled_norms(e)
        elif kind in ENDED and e.get("phase") in phases:
            phases[e["phase"]].status = ENDED[kind]
    return [phases[i] for i in sorted(phases)]


def journaled_norms(e: dict) -> dict[int | str, float] | None:
    """Layer (or module unit, where it names ``units``) -> gradient norm of a journaled ``grad_norms``
    as the runner writes it (keys and norms as long, ints or strings and floats); None for anything
    else (the runner then reads the phase's folder)."""
    keys, kind = (e["units"], str) if "units" in e else (e.get("layers"), int)
    norms = e.get("norms")
    well_formed = isinstance(keys, list) and isinstance(norms, list) and len(keys) == len(norms) and \
        all(type(x) is kind for x in keys) and all(type(x) is float for x in norms)
    return dict(zip(keys, norms)) if well_formed else None


def switch_overhead(started: dict, before: dict, done: dict) -> float | None:
    """Seconds the switch into ``done``'s phase cost, if the process that finished it (``started``)
    started where ``before``, the previous phase's phase_done in the same go, ended; else None."""
    if before["phase"] != done["phase"] - 1 or started["start_step"] != before["step"]:
        return None
    prev, rec = before.get("records") or {}, done.get("records") or {}
    times = [_finite(t) for t in (prev.get("t_last_step_end"), rec.get("t_first_step_end"),
                                  rec.get("step_seconds_median"))]
    if None in times:
        return None
    last, first, median = times
    # Records from before first_step_seconds: the median alone, which could exceed the first step.
    first_step = _finite(rec.get("first_step_seconds"))
    return first - last - (median if first_step is None else min(median, first_step))


def _finite(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None
