"""How fast a run goes, from its metrics lines: the steady step time (a phase's first step, which
carries the switch, left out) and what a switch costs, so the ETA counts the switches still ahead."""

from __future__ import annotations

import statistics
from collections import deque

from orchestrator.schedule import Phase


class Pace:
    def __init__(self, phases: list[Phase]):
        self.phases = phases
        self.steps: deque[float] = deque(maxlen=50)
        """Seconds of the recent steady steps."""
        self.switches: list[float] = []
        """Seconds a switch added: from the last step of a phase to the first of the next, less a steady step."""
        self.last: dict | None = None
        self.tokens_per_step = 0.0

    def add(self, m: dict) -> None:
        """One training line of metrics.jsonl (step, phase, time, step_seconds, tokens_per_s)."""
        first = self.last is None or m["phase"] != self.last["phase"] or m["step"] != self.last["step"] + 1
        if not first:
            self.steps.append(m["step_seconds"])
        elif self.last is not None and m["phase"] == self.last["phase"] + 1 and self.steady:
            self.switches.append(max(0.0, m["time"] - self.last["time"] - self.steady))
        self.tokens_per_step = m["tokens_per_s"] * m["step_seconds"]
        self.last = m

    @property
    def steady(self) -> float | None:
        return statistics.median(self.steps) if self.steps else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.steady if self.steady else None

    def eta(self, done: int) -> float | None:
        """Seconds left after ``done`` global steps; None until a steady step has been seen."""
        if self.steady is None:
            return None
        left = self.phases[-1].end_step - done
        switches = sum(1 for p in self.phases if p.start_step >= done and p.start_step > 0)
        per_switch = statistics.median(self.switches) if self.switches else 0.0
        return left * self.steady + switches * per_switch


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
