"""One phase's group, from its start until all of it is gone, as a small state machine:

    STARTING ─> SWITCHING ─> TRAINING ─> ENDING      (STARTING ─> TRAINING where no switch is kept quiet)
    TRAINING, ENDING ─(every rank offered its state: launch.handover)─> HANDING_OVER
    SWITCHING, TRAINING, ENDING ─(a stop signal)─> STOPPING
    any of those five ─(the group ended; its deadline passed)─> REAPING ─> DONE | FAILED | PREEMPTED

SWITCHING lasts until the phase's first step is done (or ``launch.pause_preparing_seconds`` are
up): the pre-warmed phases after the next stay paused (``orchestrator.quiet``), and the phases
further ahead start only then. ENDING is from the phase's last step on: the successors after the
next are paused for the coming switch. STOPPING forwards the orchestrator's stop signal to every
rank, which finishes its step and writes a checkpoint, until the group's ``deadline``
(``launch.grace_seconds`` after the stop). REAPING makes sure no process of the group is left;
the result is judged after it. A live group that makes no progress for ``launch.stall_seconds``
(``orchestrator.watchdog``), handing over or not, has its ranks' stacks written and goes to
REAPING, then FAILED as stalled.

HANDING_OVER (``launch.handover``): every rank has offered its state to the successor, and the
group, alive, is handed to the runner, which gives the successor its go, or, where none will take
it, declines the offer (``decline``); either way the group goes on to write its checkpoint. What
it does from then on is not the phase's training: its supervisor reads none of the lines (the
successor's does) and leaves the pauses to the successor's. A stop signal is forwarded to its
ranks as in STOPPING and gives it the same deadline; it stays HANDING_OVER. The successor's
supervisor follows it on (``predecessor``) while its own phase trains: once the group is gone it
is reaped and judged, and only then, its checkpoint committed, is the phase done. Should it fail,
the successor is SIGKILLed at once (its checkpoints would compose the lost layers) and the run
stops as for any failed phase. Where the successor ends first, the offer is declined to whoever
has not answered it, so that the checkpoint is written anyway.

Every group ends in ``_end`` (its last lines, every process gone, the verdict): one that ran to
its end or to its deadline there, one handing over once it is gone, one whose offer nobody takes
once ``decline`` has followed it to its end.

Who follows along (the progress display) is an ``Observer``: it hears every state, the phase's
stages and every line of metrics.jsonl, which the supervisor reads once for itself and for it.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable

import psutil

from launch.contract.files import RANK, PhaseDir, RunDir

from orchestrator import procs
from orchestrator.errors import PhaseFailed, Preempted, Stalled
from orchestrator.groups import Group, PhaseProcesses, log_tail
from orchestrator.journal import JsonlTail
from orchestrator.nodes import stopped_outside
from orchestrator.quiet import Pauser
from orchestrator.space import full_disk
from orchestrator.watchdog import Watchdog, dump_stacks
from shard_tools.store import Checkpoints

POLL_SECONDS = 0.02


class State(Enum):
    STARTING = "starting"
    SWITCHING = "switching"
    TRAINING = "training"
    ENDING = "ending"
    HANDING_OVER = "handing_over"
    STOPPING = "stopping"
    REAPING = "reaping"
    DONE = "done"
    FAILED = "failed"
    PREEMPTED = "preempted"


NEXT: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.SWITCHING, State.TRAINING}),
    State.SWITCHING: frozenset({State.TRAINING, State.STOPPING, State.REAPING}),
    State.TRAINING: frozenset({State.ENDING, State.HANDING_OVER, State.STOPPING, State.REAPING}),
    State.ENDING: frozenset({State.HANDING_OVER, State.STOPPING, State.REAPING}),
    State.HANDING_OVER: frozenset({State.REAPING}),
    State.STOPPING: frozenset({State.REAPING}),
    State.REAPING: frozenset({State.DONE, State.FAILED, State.PREEMPTED}),
}
"""Every transition there is; DONE, FAILED and PREEMPTED are final."""


class Observer:
    """Follows the supervised phases (the progress display); here every method does nothing."""

    def on_state(self, state: State, group: Group) -> None:
        """``group`` entered ``state`` (STARTING too, right after its ``phase_started`` event)."""

    def on_stage(self, stage: dict) -> None:
        """A line of the phase's stages.jsonl: what it is doing before its first step."""

    def on_metric(self, record: dict) -> None:
        """A line appended to the run's metrics.jsonl since the phase started."""

    def on_poll(self) -> None:
        """Each time the supervisor looks at the phase (about ten times a second)."""


@dataclass
class Context:
    """What the runner lends the supervisor of every phase."""

    run_dir: Path
    grace: float
    """``launch.grace_seconds``."""
    groups: PhaseProcesses
    pauser: Pauser
    event: Callable[..., None]
    """Journals an event."""
    stop_signal: Callable[[], int | None]
    """The stop signal the orchestrator got, if any."""
    abort: Callable[[list[Group]], None]
    """Takes pre-warmed groups down, paused ones included."""
    checkpoints: Checkpoints
    """The run's checkpoints, as the runner keeps them: a phase's end checkpoint is trusted once
    the phase is done."""
    observer: Observer = field(default_factory=Observer)
    tick: Callable[..., None] = lambda switching=False: None
    """Called at every look: journals the phases whose checkpoints became durable; ``switching``
    (near a switch, which a slow NVML check or retention's deletes would delay): only where the
    journal has fallen behind (``orchestrator.commit.BEHIND_PHASES``)."""
    flush: Callable[[], None] = lambda: None
    """Waits for every finished phase's checkpoint to be durable and journals them done: called
    before a stop or a failure is journaled, so that it is the journal's last word."""
    stall_seconds: float = math.inf
    """``launch.stall_seconds`` (``orchestrator.watchdog``)."""


def verdict(rc: int, end_whole: Callable[[], bool], stopped: bool) -> State:
    """How a phase ended: DONE where its processes exited 0 and left its end checkpoint whole
    (looked at only then), else PREEMPTED where a stop was asked for and FAILED where not."""
    if rc == 0 and end_whole():
        return State.DONE
    return State.PREEMPTED if stopped else State.FAILED


class Supervisor:
    """Supervises one group; ``ahead`` are the pre-warmed groups of the next phases, in order,
    which go down with a phase that failed or stopped. ``switched`` starts the phases further
    ahead once the switch into this one is over (None: they were started already).
    ``predecessor``: the supervisor of the phase that handed its state over to this one, still
    alive; ``predecessor_done`` is told once that phase is done."""

    def __init__(self, context: Context, group: Group, ahead: list[Group],
                 switched: Callable[[], None] | None = None, predecessor: Supervisor | None = None,
                 predecessor_done: Callable[[Group], None] = lambda group: None):
        self.ctx, self.group, self.ahead, self.switched = context, group, ahead, switched
        self.predecessor, self.predecessor_done = predecessor, predecessor_done
        self.work, self.phase = group.work, group.work.phase
        self.run_dir = context.run_dir
        self.state = State.STARTING
        self.logged_step = group.work.start_step
        """The last step this phase's rank 0 logged (metrics.jsonl's ``step``: the global steps done)."""
        self.metrics = JsonlTail(RunDir(self.run_dir).metrics)
        self.stages = JsonlTail(PhaseDir(group.phase_dir).stages)
        self.stages.offset = 0  # removed at the phase's spawn: all of it is this attempt's
        self.deadline: float | None = None
        """When the group's time is up (a stop's grace); None: unbounded."""
        self.signalled: set[int] = set()
        self.rc: int | None = None
        self.killed: list[int] = []
        self.pids: set[int] = set()
        self.watchdog = Watchdog(context.stall_seconds, self.run_dir)
        self.stall: tuple[float, Path, str] | None = None
        """Seconds without progress, the stacks' folder and rank 0's innermost frames, once stalled."""

    def run(self) -> None:
        """Returns once the phase is done (``group.end`` and ``group.records`` set) or hands its
        state over (HANDING_OVER: alive, for the successor's supervisor to follow on); raises
        Preempted or PhaseFailed (journaled) otherwise."""
        self._start()
        try:
            while self._watch():
                time.sleep(POLL_SECONDS)
            if self.state is State.HANDING_OVER and self.group.proc.poll() is None:
                return
        except BaseException:
            self._reap()
            self.ctx.groups.clean_up(self.group)
            raise
        self._end()

    def decline(self, reason: str) -> None:
        """HANDING_OVER, and the successor will not take the state: the offer is answered "not
        taken", and the group, which then writes its checkpoint, is followed to its end."""
        self.ctx.groups.decline(self.group, reason)
        while self._watch():
            time.sleep(POLL_SECONDS)
        self._end()

    def _end(self) -> None:
        """Once the group ended (or its deadline passed): its predecessor first, then the last of
        its lines, every process gone, the verdict."""
        try:
            self._end_predecessor(declined="the successor ended before it answered")
            self._drain()
        finally:
            self._reap()
        self._settle()

    def _watch_predecessor(self) -> None:
        """One look at the predecessor: once it is gone, it is ended (and so done, or raised)."""
        if self.predecessor is not None and not self.predecessor._watch():
            self._end_predecessor()

    def _end_predecessor(self, declined: str | None = None) -> None:
        """Ends the predecessor, where there is one: gone, as it stands; with ``declined``, alive:
        its offer declined for that reason to whoever has not answered it, and followed to its end.
        Done, it goes to ``predecessor_done``; should it fail, this group goes down at once."""
        pred, self.predecessor = self.predecessor, None
        if pred is None:
            return
        try:
            if declined is None:
                pred._end()
            else:
                pred.decline(declined)
        except BaseException:
            self._kill_now()
            raise
        self.predecessor_done(pred.group)

    def _kill_now(self) -> None:
        """The predecessor failed: this group's checkpoints would compose layers that are lost. Once its
        ranks are gone, what they left goes too (prepared files, bytes offered on): where this group had
        handed over already, its own supervisor has returned and cleans up nothing (CI, 2026-12-06)."""
        ranks = procs.recorded(self.group.phase_dir, RANK)
        procs.signal_all(ranks, signal.SIGKILL)
        self.ctx.event("successor_stopped", phase=self.phase.index, reason="its predecessor failed")
        procs.wait_gone(ranks, 10)
        self.ctx.groups.clean_up(self.group)

    def _enter(self, state: State) -> None:
        if state not in NEXT[self.state]:  # a bug in relayer, also under python -O
            raise RuntimeError(f"supervisor of phase {self.phase.index}: no transition {self.state} -> {state}")
        self.state = state
        self.ctx.observer.on_state(state, self.group)

    # -- the live states, one look every POLL_SECONDS ------------------------------------------
    def _start(self) -> None:
        work, ph, group = self.work, self.phase, self.group
        switching = self.switched is not None or self.ctx.pauser.active
        self.ctx.event("phase_started", phase=ph.index, start_step=work.start_step, end_step=ph.end_step,
                       layers=list(ph.layers), **({"modules": list(ph.modules)} if ph.modules else {}),
                       nproc=ph.nproc, pid=group.proc.pid,
                       restore=str(work.restore) if work.restore else None, prewarmed=group.prewarmed)
        self.ctx.observer.on_state(State.STARTING, group)
        self._enter(State.SWITCHING if switching else State.TRAINING)

    def _watch(self) -> bool:
        """One look at the group: False once it is to be reaped (it ended, or its deadline passed)
        or is handed to the runner (HANDING_OVER); a PhaseFailed where the holder of the model's
        weights has ended (``launch.resident``)."""
        self.ctx.groups.check_holder()
        self._watch_predecessor()
        if self.group.proc.poll() is not None or self._stalled():
            return False
        if self.state is not State.HANDING_OVER:
            self._look()
            if self.state is State.HANDING_OVER:
                return False
        if self.ctx.stop_signal() is not None and self.deadline is None:
            self._stop()
        return self.deadline is None or self._stopping()

    def _look(self) -> None:
        """The phase's own part of a look, until it hands over: its new lines, the transitions its
        steps make (HANDING_OVER once every rank has offered its state), the pauses."""
        self._read()
        if self.state is State.SWITCHING:
            self._switching()
        if self.ctx.pauser.overdue():
            self.ctx.pauser.resume("limit")
        self.ctx.pauser.stop_new_ranks()
        if self.state is State.TRAINING:
            self._training()
        if self.state in (State.TRAINING, State.ENDING) and self.group.offers and \
                PhaseDir(self.group.phase_dir).offered(self.group.world):
            self._enter(State.HANDING_OVER)
        else:  # during a switch only when it falls behind (orchestrator.commit): journaling takes a while
            self.ctx.tick(switching=self.state is not State.TRAINING)

    def _read(self) -> None:
        """The phase's new stages and metrics to the observer; the steps it has done."""
        for stage in self.stages.new():
            self.ctx.observer.on_stage(stage)
            self.watchdog.moved()
        for m in self.metrics.new():
            self.ctx.observer.on_metric(m)
            if m.get("phase") == self.phase.index and "loss" in m:
                self.logged_step = max(self.logged_step, m["step"])
                self.watchdog.moved()
        self.ctx.observer.on_poll()

    def _stalled(self) -> bool:
        """No progress for too long, a stop aside: the ranks' stacks are written, the group is to be
        reaped. Quiet (``watchdog.QUIET_ALLOWANCE``): before its first step, while it writes a checkpoint."""
        quiet = self.state is not State.TRAINING or self.logged_step == self.work.start_step
        idle = None if self.deadline is not None else self.watchdog.stalled(quiet)
        if idle is not None:
            self.stall = (idle, *dump_stacks(self.group.phase_dir))
        return idle is not None

    def _switching(self) -> None:
        """SWITCHING -> TRAINING once the first step is done, or the pause has lasted long enough."""
        late = time.monotonic() - self.group.since > self.ctx.pauser.limit
        if self.logged_step > self.work.start_step or late:
            self.ctx.pauser.resume("limit" if self.logged_step == self.work.start_step else "first_step")
            self._enter(State.TRAINING)
            if self.switched is not None:
                self.switched()

    def _training(self) -> None:
        """TRAINING -> ENDING from the phase's last step on: the successors after the next pause."""
        if self.logged_step >= self.phase.end_step - 1:
            self.ctx.pauser.pause(self.ahead[1:])
            self._enter(State.ENDING)

    def _stop(self) -> None:
        """A stop signal: the group has ``launch.grace_seconds`` to finish its step (or its
        checkpoint, handing over) and exit."""
        self.deadline = time.monotonic() + self.ctx.grace
        if self.state is not State.HANDING_OVER:  # which writes its checkpoint already
            self._enter(State.STOPPING)
            if self.group.offers:  # a rank whose last step ends now offers its state to nobody: it writes instead
                self.ctx.groups.decline(self.group, "stopped")
        self.ctx.event("stop_requested", phase=self.phase.index, signal=self.ctx.stop_signal())

    def waiting_for(self) -> str:
        """What the stop of this phase waits for now, in words (a repeated stop signal says them)."""
        ph = self.phase.index
        left = f" ({max(0.0, self.deadline - time.monotonic()):.0f} s of launch.grace_seconds left)" if self.deadline else ""
        if self.state is State.STOPPING:
            return f"phase {ph} to finish its step and write its checkpoint{left}"
        if self.state is State.HANDING_OVER:
            return f"phase {ph} to write its end checkpoint{left}"
        return f"phase {ph}'s processes to exit" if self.state is State.REAPING else f"phase {ph} to stop"

    def _stopping(self) -> bool:
        """Forwards the stop to every rank; False once the deadline has passed."""
        # Ranks catch SIGTERM, finish their step and write a checkpoint. Launchers do not
        # forward it, so it goes to every rank directly, also to late starters.
        ranks = [p for p in procs.recorded(self.group.phase_dir, RANK) if p.pid not in self.signalled]
        procs.signal_all(ranks, signal.SIGTERM)
        self.signalled.update(p.pid for p in ranks)
        return time.monotonic() <= self.deadline

    def _drain(self) -> None:
        """What the group did last: the ranks of a stopped phase get the rest of their time (the
        launcher may be gone while they still write their checkpoint), then the last lines (none
        after a handover: the successor's supervisor reads them)."""
        if self.deadline is not None:
            psutil.wait_procs(procs.recorded(self.group.phase_dir, RANK), timeout=max(0.0, self.deadline - time.monotonic()))
        if self.state is not State.HANDING_OVER:
            self._read()
            if self.deadline is None and self.group.proc.returncode == 0:  # it ended between two looks: the
                self._caught_up()  # switch out of it is as quiet as one a look saw coming (a loaded host)

    def _caught_up(self) -> None:
        """The transitions of the steps read last, for a group that ended before a look saw them."""
        if self.state is State.SWITCHING:
            self._switching()
        if self.state is State.TRAINING:
            self._training()

    # -- after it --------------------------------------------------------------------------
    def _reap(self) -> None:
        """REAPING: every process of the group gone, the next phase never left paused."""
        group, proc, grace = self.group, self.group.proc, self.ctx.grace
        handed_over = self.state is State.HANDING_OVER
        self._enter(State.REAPING)
        self.pids = {p.pid for p in procs.recorded(group.phase_dir)}
        self.killed = procs.reap(group.phase_dir, proc.pid, grace=grace if self.deadline is None else 1.0)
        if proc.poll() is None:
            proc.kill()
        self.rc = self.ctx.groups.wait(proc, grace)
        self.ctx.groups.close_go(group)
        if not handed_over:  # else the successor runs already, and keeps the pauses
            self.ctx.pauser.resume("its_turn", self.ahead[:1])

    def _settle(self) -> None:
        """REAPING -> DONE, FAILED or PREEMPTED."""
        group, ph, phase_dir, proc = self.group, self.phase, self.group.phase_dir, self.group.proc
        t_gone = time.time()
        self.ctx.groups.clean_up(group)
        if self.killed:
            self.ctx.event("killed", phase=ph.index, pids=self.killed)
        group.pids = self.pids
        records = {**PhaseDir(phase_dir).read_records(), **getattr(proc, "times", {}), "t_gone": t_gone}
        store = self.ctx.checkpoints
        end = store.at(ph.end_step)
        written = PhaseDir(phase_dir).end_written()  # else its successor carries its state on
        # Stopped also where every rank was signalled from outside (scancel --signal=TERM) and wrote its
        # checkpoint; not where this reap signalled them (their launcher died: a fault).
        ranks = {rec.pid for rec in PhaseDir(phase_dir).pid_records(RANK)}
        stopped = self.ctx.stop_signal() is not None or \
            (not ranks & set(self.killed) and stopped_outside(phase_dir, group.world))
        whole = (lambda: not store.faults(end, checksums=False)) if written else (lambda: True)
        state = State.FAILED if self.stall else verdict(self.rc, whole, stopped)
        self._enter(state)
        if state is State.DONE:
            # Journaled by the runner once the next phase has its go and the checkpoint is durable.
            group.records, group.end = records, end if written else None
            if written:
                store.trust(end)
            return
        self.ctx.abort(self.ahead)
        self.ctx.flush()
        raise self._preempted() if state is State.PREEMPTED else self._stalled_error() if self.stall else self._failed(end)

    def _preempted(self) -> Preempted:
        ph, sig = self.phase, self.ctx.stop_signal()
        kept, manifest, _ = self.ctx.checkpoints.newest_whole(checksums=False)
        step = manifest.global_step if manifest else 0
        self.ctx.event("preempted", phase=ph.index, step=step, signal=sig, rc=self.rc,
                       **({"checkpoint": str(kept)} if kept else {}))  # named to the user: retention keeps it
        by = f"signal {sig}" if sig is not None else "a signal to its ranks"
        return Preempted(f"preempted by {by} in phase {ph.index}; kept: the checkpoint at "
                        f"step {step} ({kept}); run the same command again to resume" if kept else
                        f"preempted by {by} in phase {ph.index} before any checkpoint; "
                        "run the same command again to start over")

    def _stalled_error(self) -> Stalled:
        ph, (idle, folder, frames) = self.phase, self.stall
        what = f"phase {ph.index} (steps {self.work.start_step}-{ph.end_step - 1}, layers {list(ph.layers)})"
        self.ctx.event("phase_stalled", phase=ph.index, seconds=round(idle, 1), stacks=str(folder),
                       reason=f"no progress for {idle:.0f} s")
        return Stalled(f"{what} stalled: no progress for {idle:.0f} s (launch.stall_seconds "
                       f"{self.ctx.stall_seconds:g}); it was ended, earlier checkpoints are intact; run the same command "
                       f"again to resume.\nevery rank's stacks: {folder}\nrank 0 was in:\n{frames}")

    def _failed(self, end: Path) -> PhaseFailed:
        work, ph, rc = self.work, self.phase, self.rc
        who, log, reasons = self.ctx.groups.failure(self.group, rc)
        if rc == 0:
            who += f", but its checkpoint {end} is missing or incomplete"
        steps = f"steps {work.start_step}-{ph.end_step - 1}"  # numbered as plan numbers them
        self.ctx.event("phase_failed", phase=ph.index, rc=rc, log=str(log), reason="; ".join([who, *reasons]),
                       reasons=reasons)
        why = "".join(f"\n  {r}" for r in [*reasons, *full_disk(self.ctx.checkpoints.root)])
        return PhaseFailed(f"phase {ph.index} ({steps}, layers {list(ph.layers)}) failed: {who}; "
                          f"earlier checkpoints are intact.{why}\nlast lines of {log}:\n{log_tail(log)}")
