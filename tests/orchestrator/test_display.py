"""The progress display as the supervisor's observer: what a person sees (off a terminal, log lines)
from the states, stages and metrics lines it is handed; it reads no file itself."""

from __future__ import annotations

import re
import time

from orchestrator.display import Display
from orchestrator.groups import Group, Work
from orchestrator.plan import plan_phases
from orchestrator.validate import load_schedule
from orchestrator.supervisor import State
from tests.conftest import schedule_dict, write_schedule


def lines(capsys) -> list[str]:
    """What was said, without the time each line starts with off a terminal."""
    out = capsys.readouterr().err.splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d ", line) for line in out)
    return [line[9:] for line in out]


def metric(step: int, phase: int, layers: list[int]) -> dict:
    return {"step": step, "phase": phase, "layers": layers, "loss": 2.5, "lr": 1e-3, "time": time.time(),
            "step_seconds": 0.5, "tokens_per_s": 64.0}


def test_display_follows_a_phase_from_the_supervisors_events(tmp_path, tiny_model, tiny_data, capsys):
    loaded = load_schedule(write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data)))
    first, second = plan_phases(loaded)[:2]
    display = Display(loaded)

    def group(phase, prewarmed: bool) -> Group:
        return Group(work=Work(phase, phase.start_step, None), phase_dir=tmp_path, proc=None, log_path=tmp_path,
                     t_start=0.0, go_fd=None, world=1, port=0, prewarmed=prewarmed)

    display.on_state(State.STARTING, group(first, prewarmed=False))
    display.on_stage({"stage": "loading the model"})
    display.on_metric(metric(1, 0, [0]))
    display.on_metric({"step": 1, "eval_loss": 2.25})
    display.on_state(State.ENDING, group(first, prewarmed=False))
    assert lines(capsys) == ["phase 0: starting its processes (importing torch and DeepSpeed)",
                             "phase 0: loading the model",
                             "step 1/30  phase 0  layers [0]  loss 2.5000  lr 1.00e-03  tok/s after a steady step  "
                             "ETA --:--",
                             "step 1: eval loss 2.2500"]
    # A pre-warmed phase prepared before its turn: that is no news when it starts.
    display.on_state(State.STARTING, group(second, prewarmed=True))
    display.on_stage({"stage": "loading the model"})
    display.on_stage({"stage": "reading what changed"})
    assert lines(capsys) == ["phase 1: reading what changed"]
