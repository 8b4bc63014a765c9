"""The phase loop: find where the run stands (``orchestrator.resume``), run the next phase in a fresh process
group and see it through until all of it is gone (``orchestrator.supervisor``), journal, repeat. Pre-warming
the phases ahead, signals and the final model live here too."""

from __future__ import annotations

import os
import shutil
import signal
import tomllib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from launch.contract.cadence import end_writes
from launch.contract.files import RunDir

from launch.contract import devmem
from orchestrator import backstop, final, procs
from orchestrator.datastep import adopt_data, stage_data
from orchestrator.dsconfig import recorded_raw
from orchestrator.groups import Group, PhaseProcesses, Work, log_tail
from orchestrator.errors import STOP_SIGNALS, PhaseFailed, Preempted, RelayerError
from orchestrator.changes import check_same_schedule
from orchestrator.commit import Cadence, Committer
from orchestrator.journal import Journal
from orchestrator.quiet import Pauser
from orchestrator.importance import Importance
from orchestrator.resume import journal_recovered, next_work, restore_point, resume_point, set_aside_after
from orchestrator.retention import in_use, named_at_stop, retain
from orchestrator.rundir import SCHEDULE_COPY, RunLock, check_entries, create_run_dir, prune_phase_dirs, read_copy, write_copy
from orchestrator.phasespec import spec_maker
from orchestrator.plan import plan_phases
from orchestrator.schedule import LoadedSchedule, Phase, cadence_seconds
from orchestrator.space import check_space
from orchestrator.supervisor import Context, Observer, State, Supervisor
from shard_tools.history import read_journal
from shard_tools.store import Checkpoints


@dataclass
class Switch:
    """The switch from the phase that finished last into the next, as the runner sees it; one for
    each phase, in this life cycle:

    - opened when the finished phase's supervisor returns, with the work that comes next (None:
      the run is complete); the run's first switch has no finished phase;
    - ``settle``, before the successor's go and at the run's end: where the finished phase is
      handing its state over and no group will take it (none was made for the work, it is gone,
      or the run stops), the offer is declined, and the phase, followed to its end, is DONE;
    - ``close``: at the successor's go, or at the run's end: a DONE phase's checkpoint is made
      durable and the phase journaled done (``orchestrator.commit``). A phase still handing over
      lives on as the successor's ``predecessor``, whose supervisor ends it.
    """

    finished: Supervisor | None
    """DONE (checkpoint committed, not yet durable) or HANDING_OVER (alive, offering its state); None at first."""
    work: Work | None

    @property
    def predecessor(self) -> Supervisor | None:
        """The finished phase, where it is handing its state over."""
        handing = self.finished is not None and self.finished.state is State.HANDING_OVER
        return self.finished if handing else None

    def settle(self, taker: Group | None, stopped: bool) -> None:
        """``taker``: the group ahead made for the work, alive, if any."""
        if self.predecessor is None or (taker is not None and taker.takes and not stopped):
            return
        self.finished.decline("stopped" if stopped else "the next phase is not pre-warmed to take it")

    def close(self, committer: Committer, successor: Group | None) -> None:
        """``successor``: the group that got its go (None: the run ends), which retention spares."""
        if self.finished is not None and self.finished.state is State.DONE:
            committer.submit(self.finished.group, successor)


class Runner:
    """Runs a schedule to completion in its run directory. ``run()`` is the whole public API."""

    def __init__(self, loaded: LoadedSchedule, *, force: bool = False, on_event: Callable[[dict], None] | None = None,
                 observer: Observer | None = None, resume_from: Path | None = None):
        self.loaded = loaded
        self.resume_from = resume_from
        self.run_dir = loaded.output_dir
        self.phases = plan_phases(loaded)
        self.force, self.complete = force, False  # complete: RUN_DIR/final is this run's, of its last step (_run)
        self.on_event = on_event or (lambda e: None)
        self.stop_signal: int | None = None
        """The first stop signal, which stops at a checkpoint; a SIGINT after it ends the run at once."""
        self.supervisor: Supervisor | None = None  # the phase running now's, whose stop a 2nd Ctrl-C cuts short
        self.changed: list[str] = []  # how the schedule given differs from the run's copy, where accepted
        self.checkpoints = Checkpoints(self.run_dir)
        self.ahead: list[Group] = []  # the pre-warmed groups of the next phases, in order
        self.groups = PhaseProcesses(self.run_dir, loaded.schedule.launch, self._event, spec_maker(loaded, self.phases))
        self.pauser = Pauser(loaded.schedule.launch.pause_preparing_seconds, self._event)
        self.committer = Committer(self._phase_done)
        self.importance = Importance(loaded, self.run_dir, self._event)  # schedule.layer_weights = "grad_norm"
        self.exporter: final.Exporter | None = None  # started before the last checkpoint exists (_prewarm_final)
        self.undurable: list[Group] = []  # done, their ends wrote no checkpoint: journaled done with the next
        self.supervision = Context(
            run_dir=self.run_dir, grace=loaded.schedule.launch.grace_seconds, groups=self.groups,
            pauser=self.pauser, event=self._event, stop_signal=lambda: self.stop_signal, abort=self._abort,
            checkpoints=self.checkpoints, observer=observer or Observer(), tick=self.committer.poll,
            flush=self._commit_all, stall_seconds=loaded.schedule.launch.stall_seconds)

    # -- entry ---------------------------------------------------------------------------------
    def run(self) -> None:
        chosen = resume_point(self.run_dir, self.resume_from) if self.resume_from is not None else None
        # Files are created 0640 and directories 0750; the umask, inherited by every phase process,
        # keeps them to the owner unless the group may read.
        umask = os.umask(0o027 if self.loaded.schedule.run.group_readable else 0o077)
        try:
            # The fork server imports (seconds) while the data is prepared and the run directory made.
            self.groups.start_early()
            self._run(chosen)
        finally:
            self.groups.stop_fork_server()  # one started early goes on every way out, bad input too
            os.umask(umask)

    def _run(self, chosen: Path | None) -> None:
        # Prepared once, here; the data of a new run before its directory exists (bad data: exit 2),
        # beside it, removed on every way out before it is adopted (bad input, a race lost for the lock).
        staged = None if (self.run_dir / SCHEDULE_COPY).exists() else stage_data(self.loaded, STOP_SIGNALS)
        with ExitStack() as held:
            if staged:
                held.callback(shutil.rmtree, staged, ignore_errors=True)
            self.complete = chosen is None and final.is_current(self.run_dir, self.phases[-1].end_step)  # hashes final/
            if not self.complete:  # a complete run writes nothing more
                check_space(self.loaded, self.phases, staged)  # before any phase process: exit 2, nothing written
            fresh = self._prepare_run_dir()
            self.journal = Journal(self.run_dir)
            held.enter_context(RunLock(self.run_dir))
            if self.changed:  # accepted: the copy says what the run goes on with
                write_copy(self.run_dir, self.copy_text)
                self._event("schedule_changed", differences=self.changed)
            adopt_data(self.loaded, staged)
            if chosen is not None:
                set_aside_after(self.checkpoints, chosen, self._event)
            old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            for s in STOP_SIGNALS:
                signal.signal(s, self._on_signal)
            disarm = backstop.arm(self.run_dir, self.loaded.schedule.launch.grace_seconds, STOP_SIGNALS)
            try:
                self._loop(fresh)
            except (PhaseFailed, Preempted):
                raise  # journaled where raised
            except (RelayerError, OSError) as e:
                self._journal_failure(e)
                raise
            finally:
                self._commit_all()  # a phase done before a failure or a stop is journaled done
                if self.exporter is not None:  # no go: it exits having written nothing
                    self.exporter.cancel()
                self.groups.stop_fork_server()
                disarm()
                for s, h in old.items():
                    signal.signal(s, h)

    def _event(self, event: str, **fields) -> None:
        self.on_event(self.journal.write(event, **fields))

    def _journal_failure(self, error: Exception) -> None:
        """For ``status``: why the run stopped, where that is not a phase's fault."""
        try:
            self._event("run_failed", reason=str(error))
        except OSError:
            pass  # the journal is what failed (a full disk): the message still reaches the user

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGHUP:  # the terminal is gone: writing to it would fail the stop
            procs.drop_terminal()
        if self.stop_signal is None:
            self.stop_signal = signum
        elif signum == signal.SIGINT:  # Ctrl-C again: the user means it, as torchrun takes it (issue #24)
            self._end_now(signum)
        else:  # a scheduler's repeated SIGTERM (LSF sends SIGINT, then SIGTERM) waits for the checkpoint
            self._event("stop_repeated", signal=signum, waiting_for=self._waiting_for())

    def _waiting_for(self) -> str:
        live = self.supervisor is not None and self.supervisor.state not in (State.DONE, State.FAILED,
                                                                            State.PREEMPTED)
        return self.supervisor.waiting_for() if live else "the orchestrator to journal what is done and exit"

    def _end_now(self, signum: int) -> None:
        """A second Ctrl-C: every process of the run is killed now, as a SIGKILLed orchestrator's
        would be; what they were writing is lost, and running again resumes from the newest whole
        checkpoint."""
        what = self._waiting_for()
        for files in RunDir(self.run_dir).phase_dirs():
            procs.signal_all(procs.recorded(files.path), signal.SIGKILL)
        ckpt, manifest, _ = self.checkpoints.newest_whole(checksums=False)
        step, named = (manifest.global_step, {"checkpoint": str(ckpt)}) if manifest else (0, {})
        self._event("preempted", step=step, signal=signum, forced=True, waiting_for=what, **named)
        kept = f"the checkpoints up to step {step}" if manifest else "no checkpoint yet (it starts again from step 0)"
        raise Preempted(f"ended at once by a second Ctrl-C (SIGINT), while waiting for {what}; kept: {kept}; "
                        "run the same command again to resume")

    # -- run directory -------------------------------------------------------------------------
    def _prepare_run_dir(self) -> bool:
        """Creates the run directory (atomically) or checks that it belongs to this schedule."""
        copy = self.run_dir / SCHEDULE_COPY
        text = self.loaded.source.read_text()
        raw = recorded_raw(self.loaded)
        if tomllib.loads(text) != raw:  # --set overrides, a deepspeed.config file: the copy records what runs
            import tomli_w

            text = f"# {self.loaded.source} with --set overrides and deepspeed.config merged in\n" + tomli_w.dumps(raw)
        self.copy_text = text
        check_entries(self.run_dir)
        if copy.exists():
            self.changed = check_same_schedule(self.loaded, self.phases, read_copy(copy), self.force)
            return False
        create_run_dir(self.run_dir, text)
        return True

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self, fresh: bool) -> None:
        self._clear_leftovers()
        switch = Switch(None, self._start_point(fresh))
        self.cadence = Cadence(cadence_seconds(self.loaded.schedule),
                               switch.work.restore if switch.work is not None else None)
        while switch.work is not None and self.stop_signal is None:
            switch = self._phase(switch)
        self._end_run(switch)

    def _phase(self, switch: Switch) -> Switch:
        """Runs ``switch.work``: its group's go closes ``switch``; it is supervised until it
        finishes; the switch after it, opened and settled."""
        group = self._go(switch)
        switch.close(self.committer, group)
        finished = self._supervise(group, switch.predecessor)
        self.importance.finished(finished.phase)  # its norms: the phases they draw can be pre-warmed now
        self.importance.draw_ready(self.phases)
        after = Switch(finished, self._work_after(finished))
        after.settle(self._prewarmed(after.work), self.stop_signal is not None)
        return after

    def _clear_leftovers(self) -> None:
        """What an orchestrator that was killed left: go FIFOs, processes, temporaries."""
        for files in RunDir(self.run_dir).phase_dirs():
            files.go.unlink(missing_ok=True)
            killed = procs.reap(files.path, None, grace=self.loaded.schedule.launch.grace_seconds)
            if killed:
                self._event("killed", phase_dir=str(files.path), pids=killed)
        for stray in self.checkpoints.remove_stray_temporaries():  # once no process can still write them
            self._event("stray_removed", path=str(stray))

    def _start_point(self, fresh: bool) -> Work | None:
        """The run's first work, from the newest whole checkpoint; the run journaled started or resumed."""
        ckpt, manifest = restore_point(self.checkpoints, self._event)
        step, self.named = (manifest.global_step if manifest else 0), named_at_stop(self.checkpoints)
        warmup_from = self.loaded.schedule.lr_schedule.warmup_from  # for changes.warmup_ran
        end = self.phases[-1].end_step
        if step < end and self.complete:  # its end checkpoint gone (a user deleted it): never trained again
            self._event("resumed", step=end, checkpoint=None, final=str(self.run_dir / final.FINAL), pid=os.getpid(),
                        warmup_from=warmup_from)
            return None
        if fresh:
            self._event("run_started", phases=len(self.phases), total_steps=self.phases[-1].end_step, pid=os.getpid(),
                        warmup_from=warmup_from)
        else:
            self._event("resumed", step=step, checkpoint=str(ckpt) if ckpt else None, pid=os.getpid(),
                        warmup_from=warmup_from)
            journal = read_journal(self.run_dir)
            journal_recovered(journal, step, self._event)
            self.importance.resume(self.phases, journal, step)  # a fresh run has no norms yet
            self.importance.draw_ready(self.phases)
        return next_work(self.phases, ckpt, manifest)

    def _work_after(self, finished: Supervisor) -> Work | None:
        """The work after ``finished``: the next phase, from the checkpoint a phase handing over is
        about to commit; else from the newest whole checkpoint."""
        if finished.state is not State.HANDING_OVER:
            ckpt, manifest = restore_point(self.checkpoints, self._event)
            return next_work(self.phases, ckpt, manifest)
        end_step = finished.phase.end_step
        nxt = self._after(finished.phase)
        return None if nxt is None else Work(nxt, end_step, self.checkpoints.at(end_step))

    def _end_run(self, switch: Switch) -> None:
        """The run ends here, all done (no work left) or stopped: no successor takes the finished
        phase's state, the pre-warmed groups go, every finished phase is journaled done, then the
        final model or the stop."""
        switch.settle(None, self.stop_signal is not None)  # a stop since the switch was settled
        self._abort(self.ahead)
        switch.close(self.committer, None)
        self.committer.poll(block=True)
        if switch.work is None:
            self._final_model()
            self._event("run_done", step=self.phases[-1].end_step)  # names the last: a stop's goes now
            if self.named:
                retain(self.checkpoints, self.loaded.schedule.checkpoint.keep_last, set(), self._event)
            return
        step, ckpt = switch.work.start_step, switch.work.restore  # named to the user: retention keeps it
        kept = ckpt is not None and ckpt == self.checkpoints.at(step) and ckpt.is_dir()
        self._event("preempted", step=step, signal=self.stop_signal, **({"checkpoint": str(ckpt)} if kept else {}))
        raise Preempted(f"stopped by signal {self.stop_signal} before phase {switch.work.phase.index}; "
                        + (f"kept: the checkpoint at step {step} ({ckpt}); " if kept else "") + "run again to resume")

    def _commit_all(self) -> None:
        """Waits for every durability fsync and journals those phases done, on the way out."""
        try:
            self.committer.poll(block=True)
        except OSError as e:
            self._journal_failure(e)

    def _after(self, phase: Phase) -> Phase | None:
        """The phase that starts where ``phase`` ends; None after the last."""
        return next((p for p in self.phases if p.start_step == phase.end_step), None)

    def _final_model(self) -> None:
        step = self.phases[-1].end_step
        if not self.loaded.schedule.run.final_model or self.complete or final.is_current(self.run_dir, step):
            return
        self._event("final_model_started", path=str(self.run_dir / final.FINAL), step=step)
        ahead, self.exporter = self.exporter, None
        out, rc, output, timings = final.write_final(self.run_dir, ahead)
        if rc != 0 and self.stop_signal is not None:
            self._event("preempted", step=step, signal=self.stop_signal)
            raise Preempted(f"stopped by signal {self.stop_signal} while writing {out}; run again to write it")
        if rc != 0:
            raise RelayerError(f"the run is complete, but writing the final model to {out} failed "
                               f"(exit code {rc}):\n{output}\nthe checkpoints are intact; run again to retry")
        self._event("final_model_written", path=str(out), step=step, seconds=timings)

    def _abort(self, groups: list[Group]) -> None:
        """Takes pre-warmed groups down, paused ones included."""
        self.pauser.resume("aborted", groups)
        self.groups.abort(groups)

    def _phase_done(self, finished: Group, current: Group | None) -> None:
        """A finished phase's checkpoint is durable: journaled done (with the phases before it whose
        ends wrote none, ``phase_trained`` until then), the device check (NVML is slow to start) and
        retention (which spares what live phases may still read: ``in_use``)."""
        ph = finished.work.phase
        if finished.end is None:  # its successor carries its layers on to a later checkpoint
            self._event("phase_trained", phase=ph.index, step=ph.end_step, layers=list(ph.layers))
            self.undurable.append(finished)
            return
        self._event("checkpoint_committed", step=ph.end_step, path=str(finished.end))
        for done in [*self.undurable, finished]:
            p = done.work.phase
            self._event("phase_done", phase=p.index, step=p.end_step, layers=list(p.layers), nproc=p.nproc,
                        seconds=done.records["t_gone"] - done.t_start, records=done.records,
                        **({"checkpoint_at": ph.end_step} if done is not finished else {}))
        self.undurable = []
        finished.end = None
        self._event("device_after_phase", phase=ph.index, nvml=devmem.snapshot(finished.pids))
        protect = in_use(current, self.supervisor, self.ahead) | self.named
        retain(self.checkpoints, self.loaded.schedule.checkpoint.keep_last, protect, self._event)
        prune_phase_dirs(self.run_dir, ph.index)

    def _prewarmed(self, work: Work | None) -> Group | None:
        """The first group ahead, where it was made for ``work`` and is alive."""
        first = self.ahead[0] if self.ahead and work is not None else None
        fits = first is not None and first.work.phase == work.phase and first.work.start_step == work.start_step
        return first if fits and first.proc.poll() is None else None

    def _go(self, switch: Switch) -> Group:
        """The group to run ``switch.work``: the first pre-warmed one when it was made for it, told
        to go (naming the predecessor, which hands its state over), else a new one."""
        work, group, predecessor = switch.work, self._prewarmed(switch.work), switch.predecessor
        # Where the predecessor hands its state over to a group that takes it, its end may write nothing.
        takes = predecessor is not None and group is not None and group.takes
        defer = not end_writes(due=self.cadence.due(), takes=takes)
        if not defer:
            self.cadence.wrote(work.restore)
        if group is None:
            return self._start_cold(work)
        self.ahead.pop(0)
        self.groups.go(group, work.restore, predecessor.group.phase_dir if predecessor is not None else None, defer)
        group.work, group.prewarmed = work, True
        group.before = predecessor.group.work.restore if predecessor is not None else None
        return group

    def _start_cold(self, work: Work) -> Group:
        """A new group for ``work``; the ones ahead, made for a future that did not come, go."""
        if self.ahead:
            first = self.ahead[0]
            rc, why = first.proc.poll(), {}
            if rc is not None:  # it died while it waited: why, for the journal (its folder may be pruned later)
                who, log, reasons = self.groups.failure(first, rc)
                why = {"who": who, "log": str(log), "reasons": reasons, "log_tail": log_tail(log, 12)}
            self._event("prewarm_unused", phase=first.work.phase.index, rc=rc, **why)
            self._abort(self.ahead)
        return self.groups.start(work, prewarm=False)

    def _prewarm_ahead(self, work: Work) -> None:
        """Starts the next ``prewarm_depth`` phases' groups, to prepare while this one trains.

        Each preloads every weight as of this phase's start; at its go it reads only what changed
        since (the layers of the phases between, and the head). Local only: the go channel is a
        FIFO on this machine.
        """
        launch, ahead = self.loaded.schedule.launch, self.ahead
        if not launch.prewarm or launch.nnodes > 1 or launch.launcher == "slurm":
            return
        last = ahead[-1].work.phase if ahead else work.phase
        while len(ahead) < launch.prewarm_depth:
            nxt = self._after(last)
            if nxt is None or nxt.drawn_later:  # drawn_later: by norms that are not all in yet
                return
            ahead.append(self.groups.start(Work(nxt, nxt.start_step, self.cadence.base), prewarm=True))
            self._event("prewarm_started", phase=nxt.index)
            last = nxt
            if self._after(nxt) is None:  # the last phase prepares: so does its final model
                self._prewarm_final()

    def _prewarm_final(self) -> None:
        """The final model's exporter (``orchestrator.final``), started with the last phase's pre-warmed group,
        else at its go (7B on an H200: the imports and the base model took ~12 s, more than the last phase's)."""
        if self.exporter is None and self.loaded.schedule.run.final_model:
            base = final.base_ahead(self.loaded)
            self.exporter = final.Exporter(self.run_dir, base)
            self._event("final_model_prewarm", base_model=base is not None)

    def _supervise(self, group: Group, predecessor: Supervisor | None) -> Supervisor:
        """Waits for a phase's group until all of it is gone, or until it hands its state over (the supervisor),
        following ``predecessor`` on, the phase that hands its state over to it. With a switch to keep quiet, the
        phases further ahead start once it is over (a start would slow it as a preparation does)."""

        def start_ahead() -> None:
            self._prewarm_ahead(group.work)
            if self._after(group.work.phase) is None:
                self._prewarm_final()

        deferred = group.prewarmed and bool(self.ahead) and self.pauser.limit > 0
        if not deferred:
            start_ahead()
        supervisor = self.supervisor = Supervisor(self.supervision, group, self.ahead, start_ahead if deferred else None,
                                                  predecessor, lambda done: self.committer.submit(done, group))
        try:
            supervisor.run()
        except BaseException:
            self._abort(self.ahead)  # already done, unless this process itself failed
            raise
        return supervisor


def run_schedule(loaded: LoadedSchedule, **kw) -> None:
    """Runs (or resumes) a schedule; raises a RelayerError subclass on failure."""
    try:
        Runner(loaded, **kw).run()
    except OSError as e:
        raise RelayerError(f"{loaded.output_dir}: {e}") from e
