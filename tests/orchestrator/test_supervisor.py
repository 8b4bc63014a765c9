"""The supervisor's state machine (orchestrator.supervisor): its transitions on the metrics lines a
phase logs, a stop signal and its grace, how it judges a group that ended, and how a group that
handed its state over ends (followed by its successor's supervisor, or settled by the runner's
Switch). The phase's own process is a stand-in where only its being alive matters; ranks that
get signals, and groups that end, are real processes. Nothing here starts a phase."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch.contract.files import Carried, Offer, PhaseDir
from launch.contract.pids import started
from orchestrator.errors import PhaseFailed, Preempted
from orchestrator.groups import Group, PhaseProcesses, Work
from orchestrator.quiet import Pauser
from orchestrator.runner import Switch
from orchestrator.schedule import LaunchSection, Phase
from orchestrator.supervisor import NEXT, Context, Observer, State, Supervisor, verdict
from shard_tools.store import Checkpoints


class Alive:
    """A group's launcher that is running (the transitions look at nothing else of it)."""

    pid = 0

    def poll(self) -> None:
        return None


class Recorder(Observer):
    def __init__(self):
        self.states: list[State] = []
        self.stages: list[dict] = []
        self.metrics: list[dict] = []

    def on_state(self, state: State, group: Group) -> None:
        self.states.append(state)

    def on_stage(self, stage: dict) -> None:
        self.stages.append(stage)

    def on_metric(self, record: dict) -> None:
        self.metrics.append(record)


class Harness:
    """A run directory and what the runner would lend the supervisor, with what it was told."""

    def __init__(self, run_dir: Path, grace: float = 10.0, limit: float = 30.0):
        self.run_dir = run_dir
        (run_dir / "checkpoints").mkdir(parents=True)
        self.events: list[tuple[str, dict]] = []
        self.stop: int | None = None
        self.aborted: list[list[Group]] = []
        self.observer = Recorder()
        self.context = Context(run_dir=run_dir, grace=grace, groups=PhaseProcesses(run_dir, LaunchSection(), self.event, self.no_spec),
                               pauser=Pauser(limit, self.event), event=self.event, stop_signal=lambda: self.stop,
                               abort=lambda pending: self.aborted.append(list(pending)),
                               checkpoints=Checkpoints(run_dir), observer=self.observer,
                               flush=lambda: self.events.append(("flushed", {})))

    @staticmethod
    def no_spec(work, phase_dir):
        raise AssertionError("the supervisor starts no phase; the runner does")

    def event(self, name: str, **fields) -> None:
        self.events.append((name, fields))

    def named(self, name: str) -> list[dict]:
        return [fields for event, fields in self.events if event == name]

    def group(self, index: int, start: int, end: int, proc=None) -> Group:
        phase_dir = self.run_dir / "phases" / f"phase-{index:04d}"
        phase_dir.mkdir(parents=True, exist_ok=True)
        phase = Phase(index=index, start_step=start, end_step=end, layers=(index,), nproc=1)
        return Group(work=Work(phase, start, None), phase_dir=phase_dir, proc=proc or Alive(),
                     log_path=phase_dir / "worker.log", t_start=time.time(), go_fd=None, world=1, port=0)

    def log(self, **record) -> None:
        """A line of metrics.jsonl, as rank 0 writes them."""
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


@pytest.fixture
def run(tmp_path) -> Harness:
    return Harness(tmp_path / "run")


def record_rank(phase_dir: Path, rank: int, proc: subprocess.Popen) -> None:
    pids = phase_dir / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"rank-{rank}.json").write_text(json.dumps({"pid": proc.pid,
                                                        "started": started(proc.pid)}))


@pytest.fixture
def sleepers():
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        started.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
        return started[-1]

    yield start
    for p in started:
        p.kill()
        p.wait()


@pytest.mark.parametrize("rc, whole, stopped, expected", [
    (0, True, False, State.DONE),
    (0, True, True, State.DONE),  # stopped after its last step: the phase is whole
    (0, False, False, State.FAILED),
    (3, None, False, State.FAILED),
    (-15, None, True, State.PREEMPTED),
    (0, False, True, State.PREEMPTED),
])
def test_verdict(rc, whole, stopped, expected):
    def end_whole() -> bool:
        assert whole is not None, "the checkpoint of a group that failed is not looked at"
        return whole

    assert verdict(rc, end_whole, stopped) is expected


def test_every_state_is_reachable_and_only_the_verdicts_are_final():
    seen, todo = {State.STARTING}, [State.STARTING]
    while todo:
        for nxt in NEXT.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(State)
    assert set(State) - set(NEXT) == {State.DONE, State.FAILED, State.PREEMPTED}


def test_a_cold_phase_trains_and_pauses_the_ones_after_next_from_its_last_step(run):
    g1, g2, g3 = run.group(1, 10, 14), run.group(2, 14, 18), run.group(3, 18, 22)
    sup = Supervisor(run.context, g1, [g2, g3])
    sup._start()
    assert sup.state is State.TRAINING and run.named("phase_started")[0]["prewarmed"] is False
    run.log(step=12, phase=1, loss=2.0)
    run.log(step=13, phase=0, loss=2.0)  # another phase's line
    run.log(step=13, phase=1, eval_loss=2.0)  # an eval line: no step done
    assert sup._watch() and sup.state is State.TRAINING and sup.logged_step == 12
    run.log(step=13, phase=1, loss=2.0)  # the last step (13) is under way
    assert sup._watch() and sup.state is State.ENDING
    assert run.named("preparing_paused") == [{"phases": [3], "pids": []}]
    assert run.observer.states == [State.STARTING, State.TRAINING, State.ENDING]
    assert [m["step"] for m in run.observer.metrics] == [12, 13, 13, 13]


def test_a_switch_lasts_until_the_first_step_then_the_phases_ahead_start(run):
    g1, g2, g3 = run.group(1, 10, 14), run.group(2, 14, 18), run.group(3, 18, 22)
    run.context.pauser.pause([g3])  # by the phase before, at its last step
    ahead = []
    sup = Supervisor(run.context, g1, [g2, g3], switched=lambda: ahead.append(sup.state))
    sup._start()
    assert sup._watch() and sup.state is State.SWITCHING and not ahead and run.context.pauser.active
    run.log(step=11, phase=1, loss=2.0)
    assert sup._watch() and sup.state is State.TRAINING
    assert ahead == [State.TRAINING] and not run.context.pauser.active
    assert [e["reason"] for e in run.named("preparing_resumed")] == ["first_step"]
    assert sup._watch() and ahead == [State.TRAINING]


def test_a_switch_ends_at_the_pause_limit_without_a_first_step(run):
    g1, g3 = run.group(1, 10, 14), run.group(3, 18, 22)
    run.context.pauser.pause([g3])
    g1.since -= run.context.pauser.limit + 1  # the monotonic clock: a step of the wall clock changes nothing
    sup = Supervisor(run.context, g1, [run.group(2, 14, 18), g3])
    sup._start()
    assert sup.state is State.SWITCHING
    assert sup._watch() and sup.state is State.TRAINING
    assert [e["reason"] for e in run.named("preparing_resumed")] == ["limit"]


def test_a_stop_goes_to_every_rank_late_ones_too_until_the_grace_is_up(run, sleepers):
    g1 = run.group(1, 10, 14)
    ranks = [sleepers(), sleepers()]
    record_rank(g1.phase_dir, 0, ranks[0])
    ahead = []
    sup = Supervisor(run.context, g1, [], switched=lambda: ahead.append(1))
    sup._start()
    run.stop = signal.SIGTERM
    assert sup._watch() and sup.state is State.STOPPING
    assert run.named("stop_requested") == [{"phase": 1, "signal": signal.SIGTERM}]
    assert ranks[0].wait(5) == -signal.SIGTERM
    record_rank(g1.phase_dir, 1, ranks[1])  # a rank that started after the stop
    run.log(step=11, phase=1, loss=2.0)
    assert sup._watch() and ranks[1].wait(5) == -signal.SIGTERM
    assert not ahead  # a phase that stops starts nothing ahead
    sup.deadline -= run.context.grace + 1
    assert not sup._watch()
    assert run.observer.states == [State.STARTING, State.SWITCHING, State.STOPPING]
    assert len(run.named("stop_requested")) == 1


@pytest.mark.parametrize("rc", [3, 0])
def test_a_group_that_ends_without_its_checkpoint_fails_and_takes_the_next_ones_down(run, rc):
    g1, g2 = run.group(1, 10, 14), run.group(2, 14, 18)
    (g1.phase_dir / "errors").mkdir()
    (g1.phase_dir / "errors" / "rank-0.txt").write_text("out of memory")
    with open(g1.log_path, "wb") as log:
        g1.proc = subprocess.Popen(["sh", "-c", f"echo its last words; exit {rc}"], stdout=log, start_new_session=True)
    with pytest.raises(PhaseFailed) as failed:
        Supervisor(run.context, g1, [g2]).run()
    who = ("its processes ended with exit code 3" if rc else
           f"its processes ended with exit code 0, but its checkpoint {run.run_dir}/checkpoints/step-00000014 "
           "is missing or incomplete")
    assert str(failed.value).startswith(f"phase 1 (steps 10-13, layers [1]) failed: {who}; earlier checkpoints are "
                                        f"intact.\n  out of memory\nlast lines of {g1.log_path}:\nits last words\n")
    assert run.named("phase_failed") == [{"phase": 1, "rc": rc, "log": str(g1.log_path),
                                          "reason": f"{who}; out of memory", "reasons": ["out of memory"]}]
    assert run.aborted == [[g2]]
    assert run.observer.states[-2:] == [State.REAPING, State.FAILED]
    # Finished phases are journaled done before the failure: it is the journal's last word.
    assert [e for e, _ in run.events][-2:] == ["flushed", "phase_failed"]


def test_a_stopped_group_is_preempted(run, sleepers):
    g1 = run.group(1, 10, 14, proc=sleepers())
    record_rank(g1.phase_dir, 0, g1.proc)
    run.stop = signal.SIGTERM
    with pytest.raises(Preempted, match="^preempted by signal 15 in phase 1 before any checkpoint; run the same "
                                        "command again to start over$"):
        Supervisor(run.context, g1, []).run()
    assert run.named("preempted") == [{"phase": 1, "step": 0, "signal": signal.SIGTERM, "rc": -signal.SIGTERM}]
    assert [e for e, _ in run.events][-2:] == ["flushed", "preempted"]
    assert run.observer.states == [State.STARTING, State.TRAINING, State.STOPPING, State.REAPING, State.PREEMPTED]


def offering(run: Harness, proc) -> Supervisor:
    """The supervisor of phase 1 (steps 10-13, its rank ``proc``) once every rank has offered its state."""
    g1 = run.group(1, 10, 14, proc=proc)
    g1.offers = True
    record_rank(g1.phase_dir, 0, proc)
    sup = Supervisor(run.context, g1, [])
    sup._start()
    run.log(step=13, phase=1, loss=2.0)
    assert sup._watch() and sup.state is State.ENDING
    carried = Carried(phase=1, global_step=20, layers=[1], head_step=20, body_step=10, scaler={}, restore=None,
                      end=str(run.run_dir / "checkpoints" / "step-00000020"))
    PhaseDir(g1.phase_dir).write_offer(0, Offer(pid=proc.pid, device="host", transport="host", blocks=[], tensors=[],
                                                carried=carried))
    assert not sup._watch() and sup.state is State.HANDING_OVER
    return sup


def answered_in_time(run: Harness) -> subprocess.Popen:
    """Phase 1's rank: it exits once its offer is answered (as it would, its checkpoint written)."""
    answer = PhaseDir(run.run_dir / "phases" / "phase-0001").answer_path(0)
    return subprocess.Popen(["sh", "-c", f"i=0; while [ ! -e {answer} ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done"])


def test_a_group_that_offered_reads_no_more_and_a_stop_bounds_its_write(run, sleepers):
    sup = offering(run, sleepers())
    run.log(step=15, phase=2, loss=1.0)  # the successor's: its own supervisor reads it
    run.stop = signal.SIGTERM
    assert sup._watch() and sup.state is State.HANDING_OVER and sup.deadline is not None
    assert sup.group.proc.wait(5) == -signal.SIGTERM
    assert not sup._watch()
    with pytest.raises(Preempted):
        sup._end()
    assert [m["step"] for m in run.observer.metrics] == [13]
    assert run.observer.states == [State.STARTING, State.TRAINING, State.ENDING, State.HANDING_OVER, State.REAPING,
                                   State.PREEMPTED]
    assert run.named("stop_requested") == [{"phase": 1, "signal": signal.SIGTERM}]


def test_a_predecessor_that_fails_takes_its_successor_down_at_once(run, sleepers):
    pred = offering(run, sleepers())
    rank = sleepers()
    g2 = run.group(2, 14, 18)
    record_rank(g2.phase_dir, 0, rank)
    # What its rank made: its prepared checkpoint files and the bytes it offered on (had it handed over,
    # its own supervisor would have returned, and cleaned up nothing after it).
    prepared = run.run_dir / "checkpoints" / f".tmp-prepared.{rank.pid}.1"
    offered = g2.phase_dir / "handover" / "rank-0.bin"
    for made in (prepared, offered):
        made.parent.mkdir(parents=True, exist_ok=True)
        made.write_bytes(b"x")
    done = []
    succ = Supervisor(run.context, g2, [], predecessor=pred, predecessor_done=done.append)
    succ._start()
    assert succ._watch()
    pred.group.proc.kill()
    pred.group.proc.wait()
    with pytest.raises(PhaseFailed, match="^phase 1 "):
        succ._watch()
    # Killed: the supervisor's wait for it (psutil.wait_procs, which reaps a child of this process)
    # may come first, and Popen then reads 0 (it lost the status); a sleep 60 ends no other way in 5 s.
    assert rank.wait(5) in (-signal.SIGKILL, 0)
    assert run.named("successor_stopped") == [{"phase": 2, "reason": "its predecessor failed"}]
    assert done == [] and succ.predecessor is None
    assert not prepared.exists() and not offered.exists()


def test_a_successor_that_ends_before_it_answered_has_the_offer_declined(run, monkeypatch):
    monkeypatch.setattr(run.context.checkpoints, "faults", lambda ckpt, checksums: [])  # the end checkpoint is whole
    pred = offering(run, answered_in_time(run))
    g2 = run.group(2, 14, 18, proc=subprocess.Popen(["sh", "-c", "exit 3"]))
    done = []
    with pytest.raises(PhaseFailed, match="^phase 2 "):
        Supervisor(run.context, g2, [], predecessor=pred, predecessor_done=done.append).run()
    assert run.named("handover_declined") == [{"phase": 1, "ranks": [0], "reason": "the successor ended before it answered"}]
    assert PhaseDir(pred.group.phase_dir).read_answer(0).by == "orchestrator"
    assert done == [pred.group] and pred.state is State.DONE
    assert pred.group.end in run.context.checkpoints.trusted


@pytest.mark.parametrize("takes, stopped, reason", [
    (None, False, "the next phase is not pre-warmed to take it"),  # no group ahead made for the work
    (False, False, "the next phase is not pre-warmed to take it"),  # one that does not take over
    (True, True, "stopped"),
])
def test_a_switch_declines_the_offer_no_group_will_take_and_commits_the_phase_at_its_close(run, monkeypatch, takes,
                                                                                          stopped, reason):
    monkeypatch.setattr(run.context.checkpoints, "faults", lambda ckpt, checksums: [])  # the end checkpoint is whole
    pred = offering(run, answered_in_time(run))
    g2 = run.group(2, 14, 18)
    g2.takes = bool(takes)
    switch = Switch(pred, g2.work)
    switch.settle(None if takes is None else g2, stopped)
    assert run.named("handover_declined") == [{"phase": 1, "ranks": [0], "reason": reason}]
    assert pred.state is State.DONE and switch.predecessor is None
    submitted = []
    switch.close(SimpleNamespace(submit=lambda finished, current: submitted.append((finished, current))), g2)
    assert submitted == [(pred.group, g2)]


def test_a_switch_whose_successor_takes_over_leaves_the_phase_to_the_successors_supervisor(run, sleepers):
    pred = offering(run, sleepers())
    g2 = run.group(2, 14, 18)
    g2.takes = True
    switch = Switch(pred, g2.work)
    switch.settle(g2, stopped=False)
    assert switch.predecessor is pred and pred.state is State.HANDING_OVER and not run.named("handover_declined")
    switch.close(SimpleNamespace(submit=lambda finished, current: pytest.fail("committed before it is done")), g2)


def test_a_transition_the_machine_does_not_have_is_a_bug_even_under_python_O(run):
    sup = Supervisor(run.context, run.group(1, 10, 14), [])
    with pytest.raises(RuntimeError, match="supervisor of phase 1: no transition State.STARTING -> State.DONE"):
        sup._enter(State.DONE)
