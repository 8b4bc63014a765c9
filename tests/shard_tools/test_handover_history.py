"""The journal of a run that hands over (#18): the next phase starts before its predecessor's
phase_done, which comes once the predecessor is gone; the replay still measures every switch."""

import pytest

from shard_tools.history import replay


def _journal() -> list[dict]:
    """Three phases of 10 steps; each phase's first step ends 2 s after it starts, its last 7 s after;
    the next phase starts 7.5 s after, its predecessor is done 9 s after (it wrote meanwhile)."""
    out = [{"event": "run_started", "time": 0.0}]
    for k in range(3):
        t0 = 7.5 * k
        out.append({"event": "phase_started", "phase": k, "start_step": 10 * k, "end_step": 10 * k + 10,
                    "layers": [k], "nproc": 1, "time": t0})
        if k:
            out.append(done(k - 1, t0 - 7.5))
    return [*out, done(2, 15.0)]


def done(k: int, t0: float) -> dict:
    records = {"t_first_step_end": t0 + 2, "t_last_step_end": t0 + 7, "step_seconds_median": 0.5}
    return {"event": "phase_done", "phase": k, "step": 10 * k + 10, "layers": [k], "nproc": 1, "seconds": 9.0,
            "records": records, "time": t0 + 9}


def test_every_switch_handed_over_is_measured():
    rows = replay(_journal())
    assert [(r.index, r.status, r.attempts) for r in rows] == [(0, "done", 1), (1, "done", 1), (2, "done", 1)]
    # Phase k's first step ends 2 s after it started, 2.5 s after phase k - 1's last; less a 0.5 s step.
    assert [r.switch_seconds for r in rows] == [None, 2.0, 2.0]
