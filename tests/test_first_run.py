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
    sched = write_schedule(tmp_path / "other" / "s.toml", schedule_dict(  # a switch, and shorter than the demo's run
        tiny_model, tiny_data, schedule={"phases": [{"steps": 5, "layers": [0]}, {"steps": 5, "layers": [1]}]}))
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("out", "err", "other")}  # a full pipe would block
    first_run = subprocess.Popen(["bash", "-e", "-c", script], cwd=ROOT, env=env, stdout=logs["out"],
                                 stderr=logs["err"], start_new_session=True)
    other = None
    try:
        # The other run starts as the demo's does, so that the two train at once.
        wait_for(lambda: (demo_run / "journal.jsonl").exists() or first_run.poll() is not None, timeout=600,
                 what="the demo's run")
        other = subprocess.Popen([ORCH, "run", str(sched)], stdout=logs["other"], stderr=subprocess.STDOUT,
                                 start_new_session=True)
        first_run.wait(timeout=1200)
        other.wait(timeout=600)
    finally:
        for proc in (first_run, other):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    out, err, other_log = ((tmp_path / f"{name}.log").read_text() for name in ("out", "err", "other"))
    for log in logs.values():
        log.close()
    r = SimpleNamespace(returncode=first_run.returncode, stdout=out, stderr=err)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert other.returncode == 0, other_log[-4000:]
    demo, beside = step_times(demo_run), step_times(tmp_path / "other" / "run")
    assert min(demo) < max(beside) and min(beside) < max(demo), "the demo and the other run never trained at once"
    demo_tail = r.stdout.split("\nnext (", 1)[1]
    for command in commands(block)[1:]:
        assert command in demo_tail, f"make demo does not print {command!r} as the README does:\n{demo_tail}"
    assert "examples/tiny/runs/tiny: done" in r.stdout
    assert (demo_run / "report.png").is_file()
    assert (mine / "final" / "config.json").is_file()
