"""The progress display's pace: steady tokens/s leaves out a phase's first step, and the ETA counts
the switches still ahead at what the switches so far cost."""

from __future__ import annotations

import pytest

from orchestrator.pace import Pace, clock
from orchestrator.schedule import Phase


def phases(*steps: int) -> list[Phase]:
    out, start = [], 0
    for i, n in enumerate(steps):
        out.append(Phase(index=i, start_step=start, end_step=start + n, layers=(i,), nproc=1))
        start += n
    return out


def line(step: int, phase: int, t: float, seconds: float) -> dict:
    return {"step": step, "phase": phase, "time": t, "step_seconds": seconds, "tokens_per_s": 1000 / seconds}


def test_first_step_of_a_phase_is_not_steady_and_switches_are_counted():
    pace = Pace(phases(3, 3, 3))
    pace.add(line(1, 0, 10.0, 8.0))  # a cold first step
    assert pace.tokens_per_s is None and pace.eta(1) is None
    pace.add(line(2, 0, 11.0, 1.0))
    pace.add(line(3, 0, 12.0, 1.0))
    assert pace.tokens_per_s == pytest.approx(1000)
    assert pace.eta(3) == pytest.approx(6 * 1.0)  # no switch seen yet: none priced
    pace.add(line(4, 1, 16.0, 2.0))  # the switch: 4 s from the last step, one of them a step
    assert pace.switches == [pytest.approx(3.0)]
    assert pace.steady == pytest.approx(1.0)
    assert pace.eta(4) == pytest.approx(5 * 1.0 + 1 * 3.0)  # one switch ahead (into phase 2)


def test_clock():
    assert [clock(None), clock(59.6), clock(125), clock(3725)] == ["--:--", "1:00", "2:05", "1:02:05"]
