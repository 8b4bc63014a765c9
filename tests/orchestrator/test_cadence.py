"""Checkpoints at the user's cadence (``checkpoint.every_seconds``, #23): where a phase hands its
state over to its successor (on the CPU ``launch.handover = "on"``, the host transport), its end
writes a checkpoint only once every_seconds have passed since the last one, and the successor
carries the layers it trained (their fp32 masters) on to the next checkpoint it writes. Nothing
trained is lost: the run ends bitwise equal to the same run with a checkpoint at every phase end,
a stop writes a checkpoint holding every carried layer, and a rerun after it ends bitwise equal too.
The kills at random moments under a cadence are in test_preemption (``cadence``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shard_tools.manifest import read_manifest
from shard_tools.store import Checkpoints
from tests.conftest import cli, schedule_dict, write_schedule
from tests.reference import bitwise_equal, composed

pytestmark = pytest.mark.multiprocess
ORCH = str(Path(sys.executable).parent / "orchestrator")
# Every layer trained more than once, the last phase's layers not the others: the last checkpoint
# carries layers 0 and 1, trained by phases whose ends wrote nothing.
PHASES = [{"steps": 2, "layers": layers} for layers in ([0, 1], [0, 3], [1, 2], [0, 2], [1, 3], [2, 3])]
NEVER = 1e6  # longer than any run here


def schedule(tmp: Path, model: Path, data: Path, every_seconds: float, **checkpoint) -> Path:
    s = schedule_dict(model, data, schedule={"phases": PHASES}, launch={"handover": "on", "prewarm_depth": 1},
                      checkpoint={"every_seconds": every_seconds, **checkpoint})
    tmp.mkdir(parents=True, exist_ok=True)
    return write_schedule(tmp / "s.toml", s)


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]


def kinds(run: Path, kind: str) -> list[dict]:
    return [e for e in events(run) if e["event"] == kind]


@pytest.fixture(scope="module")
def every_phase_run(tmp_path_factory, tiny_model, tiny_data) -> Path:
    """The run with a checkpoint at every phase end (every_seconds = 0)."""
    d = tmp_path_factory.mktemp("every-phase")
    r = cli("orchestrator", "run", str(schedule(d, tiny_model, tiny_data, 0)))
    assert r.returncode == 0, r.stderr
    assert len(kinds(d / "run", "checkpoint_committed")) == len(PHASES) and not kinds(d / "run", "phase_trained")
    return d / "run"


@pytest.fixture(scope="module")
def every_phase(every_phase_run, tiny_model) -> dict:
    """The weights of the run with a checkpoint at every phase end."""
    return composed(tiny_model, every_phase_run)


def phase_seconds(run: Path) -> float:
    """The median time from one phase's start to the next's in ``run``, as this machine ran it then."""
    starts = sorted(e["time"] for e in kinds(run, "phase_started"))
    gaps = sorted(b - a for a, b in zip(starts, starts[1:]))
    return gaps[len(gaps) // 2]


def test_a_cadence_longer_than_the_run_writes_only_at_its_end_and_ends_bitwise(tmp_path, tiny_model, tiny_data,
                                                                              every_phase):
    r = cli("orchestrator", "run", str(schedule(tmp_path, tiny_model, tiny_data, NEVER)))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    assert bitwise_equal(composed(tiny_model, run), every_phase)
    ckpts = Checkpoints(run).all()
    assert [c.name for c in ckpts] == ["step-00000012"] and len(kinds(run, "checkpoint_committed")) == 1
    m = read_manifest(ckpts[0])
    assert (m.layers, m.carried_layers) == ([2, 3], [0, 1])
    # Every phase before the last was journaled trained, then done with the checkpoint that holds it.
    assert [e["phase"] for e in kinds(run, "phase_trained")] == list(range(len(PHASES) - 1))
    done = kinds(run, "phase_done")
    assert [e["phase"] for e in done] == list(range(len(PHASES)))
    assert all(e["checkpoint_at"] == 12 for e in done[:-1]) and "checkpoint_at" not in done[-1]
    assert all(e["records"]["checkpoint_written"] is False for e in done[:-1])
    # The carried layers wait on the host (launch.carried); one the successor trains goes to the
    # device ahead of the offer: phase 1 carries layer 1 (phase 0's), which phase 2 trains.
    assert done[1]["records"]["carried_layers"] == [1] and done[1]["records"]["carried_ahead"] == [1]
    assert cli("shard-tools", "verify", str(run)).returncode == 0
    report = cli("orchestrator", "report", "--json", str(run))
    assert [p["status"] for p in json.loads(report.stdout)["phases"]] == ["done"] * len(PHASES), report.stderr
    assert not list(run.glob("phases/*/handover/*.bin")) and not list(run.glob("checkpoints/.tmp-*"))


def test_plan_shows_the_write_rate(tmp_path, tiny_model, tiny_data):
    r = cli("orchestrator", "plan", str(schedule(tmp_path, tiny_model, tiny_data, 300)))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("checkpoints:"))
    assert "one at most every 300 s (checkpoint.every_seconds)" in line and "/s" in line, line
    r = cli("orchestrator", "plan", str(schedule(tmp_path, tiny_model, tiny_data, 0)))
    assert "every phase end writes up to" in r.stdout, r.stdout


def test_a_stop_writes_every_carried_layer_and_the_rerun_ends_bitwise(tmp_path, tiny_model, tiny_data, every_phase):
    sched = schedule(tmp_path, tiny_model, tiny_data, NEVER)
    run = tmp_path / "run"
    orch = subprocess.Popen([ORCH, "run", str(sched)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ), start_new_session=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    # Into phase 3 (layers 0 and 2): phases 0-2 ended without a checkpoint, their layers carried.
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 7) and orch.poll() is None:
        assert time.time() < deadline, "no step 7"
        time.sleep(0.05)
    orch.send_signal(signal.SIGTERM)
    _, err = orch.communicate(timeout=120)
    assert orch.returncode == 75, err
    (ckpt,) = Checkpoints(run).all()
    m = read_manifest(ckpt)
    assert m.global_step >= 7 and {*m.layers, *m.carried_layers} == {0, 1, 2, 3}, (m.global_step, m.layers,
                                                                                  m.carried_layers)
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(tiny_model, run), every_phase)


def test_a_short_cadence_writes_some_phase_ends_and_ends_bitwise(tmp_path, tiny_model, tiny_data, every_phase,
                                                                 every_phase_run):
    """A cadence of about 2.5 phases (as long as the reference run's phases took on this machine,
    at least 5 s: a second each on an idle 2-core one, several beside other tests): some ends write,
    the others are carried on; retention (keep_last 2) keeps what the kept checkpoints compose from."""
    cadence = max(5.0, 2.5 * phase_seconds(every_phase_run))
    r = cli("orchestrator", "run", str(schedule(tmp_path, tiny_model, tiny_data, cadence, keep_last=2)))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    assert bitwise_equal(composed(tiny_model, run), every_phase)
    committed, trained = kinds(run, "checkpoint_committed"), kinds(run, "phase_trained")
    assert committed and trained and len(committed) + len(trained) == len(PHASES), (committed, trained)
    assert cli("shard-tools", "verify", str(run)).returncode == 0
    older = [c for c in Checkpoints(run).all() if not read_manifest(c).layers_only][0]
    r = cli("orchestrator", "run", str(tmp_path / "s.toml"), "--resume-from", str(older))
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(tiny_model, run), every_phase)
