"""A run's history: one replay of the journal, one definition of a switch's overhead, for
``orchestrator report`` and ``shard-tools inspect`` alike."""

from __future__ import annotations

import json

import pytest

from shard_tools.history import replay
from tests.conftest import cli
from tests.orchestrator.test_preemption import events, metrics_steps, schedule, start, wait_for


def _phase(k: int, start: int, t0: float, preempted: bool = False) -> list[dict]:
    """Phase k (10 steps, layer k) from ``start``: its first step ends 2 s after t0, its last 7 s after."""
    began = {"event": "phase_started", "phase": k, "start_step": start, "end_step": 10 * k + 10, "layers": [k],
             "nproc": 1, "time": t0}
    if preempted:
        return [began, {"event": "preempted", "phase": k, "step": start, "time": t0 + 3}]
    records = {"t_first_step_end": t0 + 2, "t_last_step_end": t0 + 7, "step_seconds_median": 0.5}
    return [began, {"event": "phase_done", "phase": k, "step": 10 * k + 10, "layers": [k], "nproc": 1,
                    "seconds": 8.0, "records": records, "time": t0 + 8}]


def test_downtime_between_goes_is_no_switch():
    journal = [{"event": "run_started", "time": 0.0}, *_phase(0, 0, 0.0), *_phase(1, 10, 8.0, preempted=True),
               {"event": "resumed", "step": 12, "time": 500.0}, *_phase(1, 12, 501.0), *_phase(2, 20, 509.0)]
    rows = replay(journal)
    assert [(r.index, r.start_step, r.end_step, r.status, r.attempts) for r in rows] == [
        (0, 0, 10, "done", 1), (1, 10, 20, "done", 2), (2, 20, 30, "done", 1)]
    # Phase 2's first step ends 3 s after phase 1's last (501 + 7 -> 509 + 2), less a 0.5 s step.
    assert [r.switch_seconds for r in rows] == [None, None, 2.5]
    assert [r.resumed for r in rows] == [False, True, False]


def test_a_first_step_faster_than_the_median_never_makes_a_switch_negative():
    """Seen on a loaded machine: phase 2's first step took 0.585 s, ending 0.761 s after phase 1's
    last, and its median step 0.890 s (the phases ahead resumed preparing after its first step):
    -0.13 s. The ordinary step is never more than the first step took: 0.176 s, the wait before it."""
    journal = [{"event": "run_started", "time": 0.0}, *_phase(0, 0, 0.0), *_phase(1, 10, 8.0)]
    journal[-1]["records"].update(t_first_step_end=7.0 + 0.761, step_seconds_median=0.890, first_step_seconds=0.585)
    assert replay(journal)[1].switch_seconds == pytest.approx(0.176)
    journal[-1]["records"].update(t_first_step_end=7.0 + 2.0, first_step_seconds=1.5)  # a cold one: its excess counts
    assert replay(journal)[1].switch_seconds == pytest.approx(2.0 - 0.890)


def test_a_rewound_phase_keeps_the_switch_of_its_last_attempt():
    journal = [{"event": "run_started", "time": 0.0}, *_phase(0, 0, 0.0), *_phase(1, 10, 8.0),
               {"event": "resumed", "step": 10, "time": 100.0}, *_phase(1, 10, 101.0)]
    rows = replay(journal)
    assert [r.switch_seconds for r in rows] == [None, None]
    assert rows[1].resumed and rows[1].attempts == 2


@pytest.mark.multiprocess
def test_a_phase_s_gradient_norms_are_read_only_as_the_runner_writes_them():
    """The one reading of a journaled ``grad_norms``, for ``report --json`` and the draws alike (the
    draws then read the phase's folder); a phase that measured nothing has {}."""
    journal = [*_phase(0, 0, 0.0), *_phase(1, 10, 8.0), *_phase(2, 20, 16.0),
               {"event": "grad_norms", "phase": 0, "step": 10, "layers": [0, 3], "norms": [0.5, 2.0]},
               {"event": "grad_norms", "phase": 1, "step": 20, "layers": [], "norms": []}]
    for bad in ({"layers": [1], "norms": [1]}, {"layers": [1, 2], "norms": [1.0]}, {"layers": ["1"], "norms": [1.0]},
                {"layers": [True], "norms": [1.0]}, {"layers": None, "norms": None}, {}):
        rows = replay([*journal, {"event": "grad_norms", "phase": 2, "step": 30, **bad}])
        assert [r.grad_norms for r in rows] == [{0: 0.5, 3: 2.0}, {}, None], bad


def test_inspect_and_report_agree_on_a_preempted_run(tmp_path, tiny_model, tiny_data):
    sched = schedule(tmp_path, tiny_model, tiny_data)
    run = tmp_path / "run"
    orch = start(sched)
    wait_for(lambda: metrics_steps(run) >= 11 or orch.poll() is not None, what="phase 1's first step")
    orch.terminate()
    assert orch.wait(timeout=120) == 75, orch.communicate()[1]
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr

    reported = cli("orchestrator", "report", str(run), "--json")
    inspected = cli("shard-tools", "inspect", str(run), "--json")
    assert reported.returncode == 0 and inspected.returncode == 0, (reported.stderr, inspected.stderr)
    report, inspect = json.loads(reported.stdout)["phases"], json.loads(inspected.stdout)["phases"]
    assert [(p["index"], p["switch_seconds"], p["resumed"]) for p in inspect] == [
        (p["index"], p["switch_seconds"], p["resumed"]) for p in report]
    assert not list(run.glob("report.png"))

    ev = events(run)
    resumed = next(i for i, e in enumerate(ev) if e["event"] == "resumed")
    # The phase that went on after the preemption: the time before it is downtime, not a switch.
    after = next(e["phase"] for e in ev[resumed:] if e["event"] == "phase_started")
    assert after >= 1, ev
    for p in inspect:
        assert (p["switch_seconds"] is None) == (p["index"] in (0, after)), inspect
        assert p["resumed"] == (p["index"] == after), inspect
    table = cli("shard-tools", "inspect", str(run))
    assert table.returncode == 0 and "resumed" in table.stdout, table.stdout


def test_journal_fsyncs_what_a_replay_reads_and_not_the_switch_s_notes(tmp_path, monkeypatch):
    """A note written during a switch (a pause, a pre-warm) is not fsynced: that fsync waited behind
    a multi-GB checkpoint's on the GPU; every event a replay reads still is."""
    import os

    from orchestrator.journal import UNSYNCED, Journal
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    j = Journal(tmp_path)
    for event in sorted(UNSYNCED):
        j.write(event, phase=1)
    assert synced == []
    j.write("phase_done", phase=1, step=2)
    assert len(synced) == 1
    lines = j.path.read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == [*sorted(UNSYNCED), "phase_done"]
