"""The README's "First run", run as printed, from ``make demo`` on, in this checkout (as a user runs
it after cloning: examples/tiny/runs, model and export are git-ignored), while another relayer run
trains on the machine (as a test suite runs beside someone's training).

Seen on a fresh clone: after ``make demo`` the README's next commands failed (``orchestrator:
command not found``, ``No module named 'torch'``): the tools are in .venv/bin, and nothing said so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT, schedule_dict, write_schedule
from tests.orchestrator.test_preemption import ORCH, wait_for

# alone: it is itself the run beside another, in the checkout's own examples/tiny folders.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.alone]


def first_run_block() -> str:
    """The shell block under the README's "## First run"."""
    section = ROOT.joinpath("README.md").read_text().split("\n## First run\n", 1)[1]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


def commands(block: str) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def journal(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "journal.jsonl").open()]


def step_times_or_none(run: Path) -> list[float] | None:
    """The step times logged so far, or None where the run has not logged one (its metrics file may not exist)."""
    try:
        return step_times(run) or None
    except (FileNotFoundError, json.JSONDecodeError):  # a line still being written
        return None


def step_times(run: Path) -> list[float]:
    return [json.loads(line)["time"] for line in (run / "metrics.jsonl").open()]


def test_the_readme_first_run_works_as_printed_after_make_demo_beside_another_run(tmp_path, tiny_model, tiny_data):
    block = first_run_block()
    assert commands(block)[:2] == ["make demo", "source .venv/bin/activate"]
    demo_run, mine = ROOT / "examples" / "tiny" / "runs" / "tiny", ROOT / "examples" / "tiny" / "runs" / "mine"
    for run in (demo_run, mine):  # what the demo removes first anyway; the block's own run of an earlier time
        shutil.rmtree(run, ignore_errors=True)
    # A user's shell: no venv on PATH, nothing of the tests' environment but the CPU.
    env = {"PATH": os.defpath, "HOME": os.environ["HOME"], "DS_ACCELERATOR": "cpu", "LANG": "C.UTF-8"}
    # make must not reinstall .venv under the running tests should pyproject.toml be newer than its stamp.
    script = block.replace("make demo", "make -o .venv/.installed demo", 1)
    (tmp_path / "other").mkdir()
    # The other run switches every 5 steps and outlasts the block: it trains before the block starts
    # and is stopped after the block has ended (it must then stop as a stop does: exit 75). Started when
    # the demo's run started instead, it came to train only after the demo's 3 s of steps (CI, 2026-12-06).
    other_phases = [{"steps": 5, "layers": [i % 2]} for i in range(4000)]
    sched = write_schedule(tmp_path / "other" / "s.toml", schedule_dict(tiny_model, tiny_data,
                                                                       schedule={"phases": other_phases}))
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("out", "err", "other")}  # a full pipe would block
    other = subprocess.Popen([ORCH, "run", str(sched)], stdout=logs["other"], stderr=subprocess.STDOUT,
                             start_new_session=True)
    first_run = None
    try:
        wait_for(lambda: step_times_or_none(tmp_path / "other" / "run") or other.poll() is not None, timeout=600,
                 what="the other run's first step")
        first_run = subprocess.Popen(["bash", "-e", "-c", script], cwd=ROOT, env=env, stdout=logs["out"],
                                     stderr=logs["err"], start_new_session=True)
        first_run.wait(timeout=1200)
        still = other.poll() is None
        other.send_signal(signal.SIGTERM)
        other.wait(timeout=120)
    finally:
        for proc in (first_run, other):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    out, err, other_log = ((tmp_path / f"{name}.log").read_text() for name in ("out", "err", "other"))
    for log in logs.values():
        log.close()
    r = SimpleNamespace(returncode=first_run.returncode, stdout=out, stderr=err)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert still and other.returncode == 75 and "by signal 15" in other_log, other_log[-4000:]
    demo, beside = step_times(demo_run), step_times(tmp_path / "other" / "run")
    assert min(demo) < max(beside) and min(beside) < max(demo), "the demo and the other run never trained at once"
    switches = {e["phase"] for e in journal(tmp_path / "other" / "run") if e["event"] == "phase_started"
                and min(demo) <= e["time"] <= max(demo)}
    assert switches, "the other run did not switch while the demo trained"
    demo_tail = r.stdout.split("\nnext (", 1)[1]
    for command in commands(block)[1:]:
        assert command in demo_tail, f"make demo does not print {command!r} as the README does:\n{demo_tail}"
    assert "examples/tiny/runs/tiny: done" in r.stdout
    assert (demo_run / "report.png").is_file()
    assert (mine / "final" / "config.json").is_file()
