"""The progress display as the supervisor's observer: what a person sees (off a terminal, log lines)
from the states, stages and metrics lines it is handed; it reads no file itself."""

from __future__ import annotations

import io
import json
import re
import time

from rich.console import Console

from orchestrator import display as display_module
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
    display = Display(loaded, machine_has_gpu=True)

    def group(phase, prewarmed: bool) -> Group:
        return Group(work=Work(phase, phase.start_step, None), phase_dir=tmp_path, proc=None, log_path=tmp_path,
                     t_start=0.0, go_fd=None, world=1, port=0, prewarmed=prewarmed)

    display.on_state(State.STARTING, group(first, prewarmed=False))
    display.on_stage({"stage": "loading the model"})
    display.on_metric(metric(1, 0, [0]))
    display.on_metric({"step": 1, "eval_loss": 2.25, "eval_loss/alpaca": 2.0, "eval_loss/chats": 2.5})
    display.on_state(State.ENDING, group(first, prewarmed=False))
    assert lines(capsys) == ["phase 0: starting its processes (importing torch and DeepSpeed)",
                             "phase 0: loading the model",
                             "step 1/30  phase 0  layers [0]  loss 2.5000  lr 1.00e-03  tok/s after a steady step  "
                             "ETA --:--",
                             "step 1: eval loss 2.2500 (alpaca 2.0000, chats 2.5000)"]
    # A pre-warmed phase prepared before its turn: that is no news when it starts.
    display.on_state(State.STARTING, group(second, prewarmed=True))
    display.on_stage({"stage": "loading the model"})
    display.on_stage({"stage": "reading what changed"})
    assert lines(capsys) == ["phase 1: reading what changed"]


def group_of(phase, tmp_path, prewarmed: bool = False) -> Group:
    return Group(work=Work(phase, phase.start_step, None), phase_dir=tmp_path, proc=None, log_path=tmp_path,
                 t_start=0.0, go_fd=None, world=1, port=0, prewarmed=prewarmed)


def test_the_comm_ops_build_is_said_with_how_long_it_took(tmp_path, tiny_model, tiny_data, capsys, monkeypatch):
    """Seen: make demo sat 2.5 minutes on "starting its processes" while DeepSpeed's CPU comm op
    was built, without a word; a start quiet for a minute now says what it still waits for."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    loaded = load_schedule(write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data)))
    display = Display(loaded, machine_has_gpu=False)
    display.on_state(State.STARTING, group_of(plan_phases(loaded)[0], tmp_path))
    display._last_said -= Display.QUIET  # a minute without a line
    display._started -= Display.QUIET
    display.on_poll()
    (tmp_path / "ext" / "deepspeed_shm_comm").mkdir(parents=True)
    (tmp_path / "ext" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"x" * 3)
    (tmp_path / "ext" / "deepspeed_shm_comm" / "relayer-built.json").write_text(
        json.dumps({"library": "deepspeed_shm_comm.so", "size": 3, "seconds": 216.4}))
    display.on_stage({"stage": "loading the model"})
    said = lines(capsys)
    assert said[0].startswith("phase 0: starting its processes (importing torch and DeepSpeed); first DeepSpeed's "
                              "CPU comm op is built for these Python, torch and DeepSpeed versions (once: ")
    assert said[1].startswith("phase 0: still waiting for its processes to start (1:0") and "comm op" in said[1]
    assert said[2] == ("DeepSpeed's CPU comm op built in 216 s, once for these Python, torch and DeepSpeed versions "
                       f"({tmp_path / 'ext'}); later runs load it")
    assert said[3] == "phase 0: loading the model"
    later = Display(loaded, machine_has_gpu=False)  # built: nothing said of it
    later.on_state(State.STARTING, group_of(plan_phases(loaded)[0], tmp_path))
    assert lines(capsys) == ["phase 0: starting its processes (importing torch and DeepSpeed)"]


def test_an_80_column_bar_keeps_the_step_counter_and_says_what_it_waits_for(tmp_path, tiny_model, tiny_data,
                                                                          monkeypatch):
    """Seen: at 80 columns the counter was cut first (``18…``); the bar sat at 0/43 for 30 s before
    the first step with no word of what it waited for."""
    out = io.StringIO()
    monkeypatch.setattr(display_module, "console", Console(file=out, width=80, force_terminal=True,
                                                           color_system=None))
    loaded = load_schedule(write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data)))
    display = Display(loaded, machine_has_gpu=True)
    display.on_state(State.STARTING, group_of(plan_phases(loaded)[0], tmp_path))
    display.on_stage({"stage": "building the engine"})

    def bar() -> str:
        shown = io.StringIO()
        Console(file=shown, width=80, color_system=None).print(display._progress.get_renderable())
        return shown.getvalue().strip()

    assert bar().startswith("0/30 phase 0 layers [0]  waiting for: building the engine"), bar()
    display.on_metric({**metric(18, 1, [1]), "loss": 4.58164, "tokens_per_s": 12345.0})
    line = bar()
    assert line.startswith("18/30 phase 0 layers [0]  loss 4.5816  lr 1.00e-03") and len(line) <= 80, line


def test_status_shows_each_events_details_whole(tmp_path):
    """Seen: status's events table cut every event's details at 100 characters (a failure's reason)."""
    from orchestrator.display import print_status

    reason = "rank 0: " + " ".join(f"word{i}" for i in range(60)) + " THE END"
    (tmp_path / "journal.jsonl").write_text(json.dumps({"time": 0, "event": "phase_failed", "phase": 0,
                                                        "reason": reason}) + "\n")
    out = io.StringIO()
    from contextlib import redirect_stdout

    with redirect_stdout(out):
        print_status(tmp_path)
    flat = re.sub(r"[\s│|]+", " ", out.getvalue())
    assert "word59 THE END" in flat, out.getvalue()
