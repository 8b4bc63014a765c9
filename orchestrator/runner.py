"""The phase loop: find where the run stands, run the next phase in a fresh process group, make
sure all of it is gone, journal, repeat. Preemption and resume live here too.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import psutil

from launch.contract import lr_at

from orchestrator import devmem, final, procs
from orchestrator.datastep import adopt_data, data_spec, stage_data
from orchestrator.groups import GO_FIFO, Group, PhaseProcesses, Work, log_tail
from orchestrator.errors import PhaseFailed, Preempted, RelayerError, RunLocked, ScheduleError
from orchestrator.journal import Journal, JsonlTail
from orchestrator.quiet import Pauser
from orchestrator.plan import check_batch, plan_phases
from orchestrator.schedule import LoadedSchedule, Phase
from orchestrator.validate import tokenizer_of, validate_schedule
from shard_tools.manifest import (
    CheckpointError, Manifest, checkpoints_dir, fsync_path, is_checkpoint_dir, layer_sources, list_checkpoints,
    make_durable, needed_by, newest_valid, read_manifest, remove_stray_temporaries, step_of, verify_checkpoint,
)

SCHEDULE_COPY = "schedule.toml"
LOCK = "orchestrator.lock"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def next_work(phases: list[Phase], ckpt: Path | None, manifest: Manifest | None) -> Work | None:
    if manifest is None:
        return Work(phases[0], 0, None)
    g = manifest.global_step
    if manifest.phase_complete:
        for ph in phases:
            if ph.start_step == g:
                return Work(ph, g, ckpt)
        if g >= phases[-1].end_step:
            return None
        raise ScheduleError(f"the newest checkpoint ends a phase at step {g}, where no phase of the schedule starts")
    ph = next((p for p in phases if p.start_step <= g < p.end_step), None)
    if ph is None or ph.index != manifest.phase or list(ph.layers) != manifest.layers:
        raise ScheduleError(
            f"the newest checkpoint is inside phase {manifest.phase} (layers {manifest.layers}) at step {g}, "
            f"which the schedule no longer has"
        )
    return Work(ph, g, ckpt)


class RunLock:
    """One orchestrator per run directory: an flock the kernel drops when its holder dies."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(f"{self.path.parent}: another orchestrator (pid {holder}) is running this run") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedule_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}{key}"
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += schedule_differences(a, b, path + ".")
        elif a != b:
            diffs.append(f"{path}: {a!r} -> {b!r}")
    return diffs


def _without_output_dir(raw: dict) -> dict:
    run = raw.get("run", {})
    return {**raw, "run": {k: v for k, v in run.items() if k != "output_dir"}} if isinstance(run, dict) else raw


def changed_lr(old: LoadedSchedule, old_phases: list[Phase], new: LoadedSchedule, new_phases: list[Phase],
               done_step: int) -> str | None:
    """How the lr of a step already taken would change (a new total_steps moves a decaying lr), or None."""
    def opt(loaded: LoadedSchedule, phases: list[Phase]) -> SimpleNamespace:
        s = loaded.schedule
        return SimpleNamespace(lr=s.optimizer.lr, lr_kind=s.lr_schedule.kind, warmup_steps=s.lr_schedule.warmup_steps,
                               total_steps=phases[-1].end_step)

    a, b = opt(old, old_phases), opt(new, new_phases)
    for step in range(done_step):
        if lr_at(step, a) != lr_at(step, b):
            return (f"lr of step {step}, already taken, would change: {lr_at(step, a):.6g} -> {lr_at(step, b):.6g} "
                    f"(lr {a.lr:g}, {a.lr_kind}, warmup_steps {a.warmup_steps}, total_steps {a.total_steps} -> "
                    f"lr {b.lr:g}, {b.lr_kind}, warmup_steps {b.warmup_steps}, total_steps {b.total_steps})")
    return None


class Runner:
    """Runs a schedule to completion in its run directory. ``run()`` is the whole public API."""

    def __init__(self, loaded: LoadedSchedule, *, force: bool = False, on_event: Callable[[dict], None] | None = None,
                 progress: Callable[[Path, Phase, int], Callable[[], None]] | None = None,
                 resume_from: Path | None = None):
        self.loaded = loaded
        self.resume_from = resume_from
        self.run_dir = loaded.output_dir
        self.phases = plan_phases(loaded)
        self.force = force
        self.on_event = on_event or (lambda e: None)
        self.progress = progress
        self.stop_signal: int | None = None
        self.verified: set[Path] = set()
        self.live_pending: list[Group] = []
        self.groups = PhaseProcesses(self.run_dir, loaded.schedule.launch, self._event)
        self.pauser = Pauser(loaded.schedule.launch.pause_preparing_seconds, self._event)

    # -- entry ---------------------------------------------------------------------------------
    def run(self) -> None:
        chosen = resume_point(self.run_dir, self.resume_from) if self.resume_from is not None else None
        # Files are created 0640 and directories 0750; the umask, inherited by every phase process,
        # keeps them to the owner unless the group may read.
        umask = os.umask(0o027 if self.loaded.schedule.run.group_readable else 0o077)
        try:
            self._run(chosen)
        finally:
            os.umask(umask)

    def _run(self, chosen: Path | None) -> None:
        # Prepared once, here; the data of a new run before its directory exists (bad data: exit 2).
        staged = None if (self.run_dir / SCHEDULE_COPY).exists() else stage_data(self.loaded)
        try:
            fresh = self._prepare_run_dir()
        except BaseException:
            if staged:
                shutil.rmtree(staged, ignore_errors=True)
            raise
        self.journal = Journal(self.run_dir)
        with RunLock(self.run_dir):
            adopt_data(self.loaded, staged)
            if chosen is not None:
                self._set_aside_after(chosen)
            old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            for s in STOP_SIGNALS:
                signal.signal(s, self._on_signal)
            try:
                self._loop(fresh)
            except (PhaseFailed, Preempted):
                raise  # journaled where raised
            except (RelayerError, OSError) as e:
                self._journal_failure(e)
                raise
            finally:
                self.groups.stop_fork_server()
                for s, h in old.items():
                    signal.signal(s, h)

    def _set_aside_after(self, chosen: Path) -> None:
        """--resume-from: the checkpoints after ``chosen`` move to checkpoints/.set-aside-<time>/, where
        readers and retention do not look and nothing deletes them."""
        later = [c for c in list_checkpoints(self.run_dir) if step_of(c) > step_of(chosen)]
        if not later and not (self.run_dir / final.FINAL).exists():
            return
        aside = checkpoints_dir(self.run_dir) / f".set-aside-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        aside.mkdir(mode=0o750)
        for ckpt in later:
            os.replace(ckpt, aside / ckpt.name)
        if (self.run_dir / final.FINAL).exists():  # made from the later checkpoints; the run writes it anew
            os.replace(self.run_dir / final.FINAL, aside / final.FINAL)
        fsync_path(checkpoints_dir(self.run_dir))
        self.verified.add(chosen)
        self._event("checkpoints_set_aside", resume_from=str(chosen), to=str(aside), checkpoints=[c.name for c in later])

    def _event(self, event: str, **fields) -> None:
        self.on_event(self.journal.write(event, **fields))

    def _journal_failure(self, error: Exception) -> None:
        """For ``status``: why the run stopped, where that is not a phase's fault."""
        try:
            self._event("run_failed", reason=str(error))
        except OSError:
            pass  # the journal is what failed (a full disk): the message still reaches the user

    def _on_signal(self, signum, _frame) -> None:
        self.stop_signal = signum

    # -- run directory -------------------------------------------------------------------------
    def _prepare_run_dir(self) -> bool:
        """Creates the run directory (atomically) or checks that it belongs to this schedule."""
        rd = self.run_dir
        copy = rd / SCHEDULE_COPY
        text = self.loaded.source.read_text()
        if tomllib.loads(text) != self.loaded.raw:  # --set overrides: the copy records what runs
            import tomli_w

            text = f"# {self.loaded.source} with --set overrides\n" + tomli_w.dumps(self.loaded.raw)
        if copy.exists():
            self._check_same_schedule(self._read_copy(copy))
            return False
        if rd.exists() and any(p.name != LOCK for p in rd.iterdir()):
            raise ScheduleError(f"{rd}: the output directory exists, is not empty and holds no relayer run")
        tmp = rd.parent / f".tmp-{rd.name}.{os.getpid()}"
        try:
            rd.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir(mode=0o750)
        except OSError as e:
            raise ScheduleError(f"{rd}: cannot create the run directory: {e.strerror or e}") from None
        try:
            (tmp / SCHEDULE_COPY).write_text(text)
            (tmp / "checkpoints").mkdir()
            (tmp / "phases").mkdir()
            if rd.exists():
                # Only a lock file is there (the rest removed by hand, say): the folder is free
                # unless an orchestrator holds the lock.
                with RunLock(rd):
                    (rd / LOCK).unlink(missing_ok=True)
                rd.rmdir()
            os.replace(tmp, rd)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return True

    def _read_copy(self, copy: Path) -> dict:
        """The run's own copy of its schedule, which a person may have edited: bad input naming it."""
        if not copy.is_file():  # a FIFO would block the read
            raise ScheduleError(f"{copy}: expected the run's copy of its schedule, a regular file")
        try:
            return tomllib.loads(copy.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ScheduleError(f"{copy}: expected a UTF-8 TOML file: {e.reason} at byte {e.start}") from None
        except tomllib.TOMLDecodeError as e:
            raise ScheduleError(f"{copy}: TOML syntax error: {e}") from None
        except OSError as e:
            raise ScheduleError(f"{copy}: cannot read the run's schedule copy: {e.strerror or e}") from None

    def _check_same_schedule(self, old_raw: dict) -> None:
        diffs = schedule_differences(_without_output_dir(old_raw), _without_output_dir(self.loaded.raw))
        if not diffs:
            return
        _, manifest, _ = newest_valid(self.run_dir, checksums=False)
        done_step = manifest.global_step if manifest else 0
        try:
            old_loaded = validate_schedule(old_raw, self.loaded.source)
            old_planned = plan_phases(old_loaded)
        except ScheduleError as e:
            # Messages name the user's file: the copy's relative paths are resolved from there.
            raise ScheduleError(f"{self.run_dir / SCHEDULE_COPY}: the schedule this run was started with is no "
                                f"longer valid (edited?): {e}") from None
        old_phases = [p for p in old_planned if p.start_step < done_step]
        new_phases = [p for p in self.phases if p.start_step < done_step]
        # Where and how the work runs does not change what it computes; phases and the lr are compared below.
        changes_done = [d for d in diffs if not d.startswith(("schedule.", "launch.", "checkpoint.", "deepspeed.zero_stage",
                                                              "lr_schedule.", "optimizer.lr:", "run.final_model",
                                                              "run.group_readable", "run.report_to", "run.tensorboard"))]
        lr_change = changed_lr(old_loaded, old_planned, self.loaded, self.phases, done_step)
        if lr_change:
            changes_done.append(lr_change)
        same_done = [(p.start_step, p.end_step, p.layers) for p in old_phases] == [
            (p.start_step, p.end_step, p.layers) for p in new_phases]
        if not same_done:
            changes_done.append("schedule: phases already run (in part or whole) differ")
        if changes_done and not self.force:
            raise ScheduleError(
                f"{self.loaded.source}: differs from the schedule this run was started with "
                f"({self.run_dir / SCHEDULE_COPY}) in ways that alter completed work:\n  "
                + "\n  ".join(diffs + [lr_change] * bool(lr_change)) + "\nuse --force to go on anyway"
            )

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self, fresh: bool) -> None:
        for phase_dir in sorted((self.run_dir / "phases").glob("phase-*")):
            (phase_dir / GO_FIFO).unlink(missing_ok=True)  # left by an orchestrator that was killed
            killed = procs.reap(phase_dir, None, grace=self.loaded.schedule.launch.grace_seconds)
            if killed:
                self._event("killed", phase_dir=str(phase_dir), pids=killed)
        for stray in remove_stray_temporaries(self.run_dir):  # once no process can still write them
            self._event("stray_removed", path=str(stray))
        first = True
        pending: list[Group] = []  # pre-warmed groups of the next phases, in order
        finished: Group | None = None
        while True:
            ckpt, manifest = self._restore_point()
            work = next_work(self.phases, ckpt, manifest)
            if first:
                if fresh:
                    self._event("run_started", phases=len(self.phases), total_steps=self.phases[-1].end_step,
                                pid=os.getpid())
                else:
                    self._event("resumed", step=manifest.global_step if manifest else 0,
                                checkpoint=str(ckpt) if ckpt else None, pid=os.getpid())
                first = False
            if work is None:
                self._abort(pending)
                self._after_switch(finished, None)
                self._final_model()
                self._event("run_done", step=self.phases[-1].end_step)
                return
            if self.stop_signal is not None:
                self._abort(pending)
                self._after_switch(finished, None)
                self._event("preempted", step=work.start_step, signal=self.stop_signal)
                raise Preempted(f"stopped by signal {self.stop_signal} before phase {work.phase.index}; run again to resume")
            current = self._take(pending, work)
            self._after_switch(finished, current)
            # With a switch to keep quiet, the phases further ahead start once it is over (a start
            # would slow it as much as a preparation does).
            defer = current.prewarmed and bool(pending) and self.pauser.limit > 0
            if not defer:
                self._prewarm_ahead(pending, work)
            try:
                self._supervise(current, pending, ahead=defer)
            except BaseException:
                self._abort(pending)  # already done, unless this process itself failed
                raise
            finished = current

    def _final_model(self) -> None:
        step = self.phases[-1].end_step
        if not self.loaded.schedule.run.final_model or final.is_current(self.run_dir, step):
            return
        self._event("final_model_started", path=str(self.run_dir / final.FINAL), step=step)
        out, rc, output = final.write_final(self.run_dir)
        if rc != 0 and self.stop_signal is not None:
            self._event("preempted", step=step, signal=self.stop_signal)
            raise Preempted(f"stopped by signal {self.stop_signal} while writing {out}; run again to write it")
        if rc != 0:
            raise RelayerError(f"the run is complete, but writing the final model to {out} failed "
                               f"(exit code {rc}):\n{output}\nthe checkpoints are intact; run again to retry")
        self._event("final_model_written", path=str(out), step=step)

    def _abort(self, pending: list[Group]) -> None:
        self.pauser.resume("aborted", pending)
        self.groups.abort(pending)

    def _after_switch(self, finished: Group | None, current: Group | None) -> None:
        """What can wait until the next phase has its go: the finished phase's device check (NVML
        is slow to start) and retention (which must spare what ``current`` may still be loading)."""
        if finished is None or finished.end is None:
            return
        ph = finished.work.phase
        make_durable(finished.end)
        self._event("checkpoint_committed", step=ph.end_step, path=str(finished.end))
        self._event("phase_done", phase=ph.index, step=ph.end_step, layers=list(ph.layers), nproc=ph.nproc,
                    seconds=finished.records["t_gone"] - finished.t_start, records=finished.records)
        finished.end = None
        self._event("device_after_phase", phase=ph.index, nvml=devmem.snapshot(finished.pids))
        protect = {g.preload for g in (current, *self.live_pending) if g is not None and g.preload}
        self._retain(protect=protect)

    def _take(self, pending: list[Group], work: Work) -> Group:
        """The group to run ``work``: the first pre-warmed one when it was made for it, else a new one
        (and then the others, made for a future that did not come, go too)."""
        if pending:
            first = pending[0]
            fits = first.work.phase == work.phase and first.work.start_step == work.start_step
            if fits and first.proc.poll() is None:
                pending.pop(0)
                self.groups.go(first, work.restore)
                first.work = work
                first.prewarmed = True
                return first
            self._event("prewarm_unused", phase=first.work.phase.index, rc=first.proc.poll())
            self._abort(pending)
        return self._spawn(work, prewarm=False)

    def _prewarm_ahead(self, pending: list[Group], work: Work) -> None:
        """Starts the next ``prewarm_depth`` phases' groups, to prepare while this one trains.

        Each preloads every weight as of this phase's start; at its go it reads only what changed
        since (the layers of the phases between, and the head). Local only: the go channel is a
        FIFO on this machine.
        """
        launch = self.loaded.schedule.launch
        self.live_pending = pending
        if not launch.prewarm or launch.nnodes > 1 or launch.launcher == "slurm":
            return
        last = pending[-1].work.phase if pending else work.phase
        while len(pending) < launch.prewarm_depth:
            nxt = next((p for p in self.phases if p.start_step == last.end_step), None)
            if nxt is None:
                return
            pending.append(self._spawn(Work(nxt, nxt.start_step, work.restore), prewarm=True))
            self._event("prewarm_started", phase=nxt.index)
            last = nxt

    def _restore_point(self) -> tuple[Path | None, Manifest | None]:
        """The newest checkpoint that is whole, and whose layer sources are whole too.

        Damaged ones are journaled and skipped, never deleted. Checksums are read once per
        checkpoint per orchestrator: what this process verified or committed stays trusted.
        """
        for ckpt in reversed(list_checkpoints(self.run_dir)):
            faults = self._verify(ckpt)
            if not faults:
                try:
                    sources = set(layer_sources(self.run_dir, ckpt).values()) - {ckpt}
                    faults = [f for src in sorted(sources) for f in self._verify(src)]
                except CheckpointError as e:
                    faults = [str(e)]
            if not faults:
                return ckpt, read_manifest(ckpt)
            for fault in faults:
                self._event("checkpoint_skipped", checkpoint=str(ckpt), fault=fault)
        return None, None

    def _verify(self, ckpt: Path) -> list[str]:
        if ckpt in self.verified:
            return []
        faults = verify_checkpoint(ckpt)
        if not faults:
            self.verified.add(ckpt)
        return faults

    def _spec(self, work: Work, phase_dir: Path) -> dict:
        s = self.loaded.schedule
        ph = work.phase
        check_batch(s.data, ph.nproc, self.loaded.source, ph.index, nnodes=s.launch.nnodes)
        return {
            "run_dir": str(self.run_dir), "phase_dir": str(phase_dir), "seed": s.run.seed,
            "tensorboard": s.run.tensorboard or "tensorboard" in s.run.report_to, "wandb": "wandb" in s.run.report_to,
            "phase": ph.index, "start_step": work.start_step, "phase_start_step": ph.start_step,
            "end_step": ph.end_step, "layers": list(ph.layers),
            "restore": str(work.restore) if work.restore else None,
            "model": {"path": str(self.loaded.model_path) if self.loaded.model_path else None,
                      "config": s.model.config, "dtype": s.model.dtype, "persistent": s.model.persistent,
                      "layers": s.model.layers, "gradient_checkpointing": s.model.gradient_checkpointing,
                      "tokenizer": str(t) if (t := tokenizer_of(s.model, self.loaded.source.parent)) else None},
            "data": data_spec(self.loaded),
            "optimizer": {"lr": s.optimizer.lr, "weight_decay": s.optimizer.weight_decay,
                          "betas": list(s.optimizer.betas), "eps": s.optimizer.eps,
                          "grad_clip": s.optimizer.grad_clip, "lr_kind": s.lr_schedule.kind,
                          "warmup_steps": s.lr_schedule.warmup_steps, "total_steps": self.phases[-1].end_step},
            "zero_stage": s.deepspeed.zero_stage, "deepspeed_config": s.deepspeed.config,
            "every_steps": s.checkpoint.every_steps, "launcher": s.launch.launcher, "nproc": ph.nproc,
            "nnodes": s.launch.nnodes,
            "hostfile": str((self.loaded.source.parent / s.launch.hostfile).resolve()) if s.launch.hostfile else None,
            "master_port": free_port(), "orchestrator_pid": os.getpid(), "orchestrator_host": socket.gethostname(),
        }

    def _spawn(self, work: Work, prewarm: bool) -> Group:
        phase_dir = self.groups.phase_dir(work.phase)
        return self.groups.spawn(work, phase_dir, self._spec(work, phase_dir), prewarm)

    def _supervise(self, group: Group, pending: list[Group], ahead: bool = False) -> None:
        """Waits for a phase's group, makes sure all of it is gone, and judges the result; the
        pre-warmed successors go down with a phase that failed or stopped.

        Keeps switches quiet (``orchestrator.quiet``): pauses the successors after the next from
        this phase's last step on, lets the paused ones go on once this phase has done its first
        step, and only then (with ``ahead``) starts the phases further ahead."""
        work, ph, phase_dir, proc = group.work, group.work.phase, group.phase_dir, group.proc
        grace = self.loaded.schedule.launch.grace_seconds
        steps = JsonlTail(self.run_dir / "metrics.jsonl")
        done = work.start_step  # the global step this phase's rank 0 has logged last
        switching = ahead or self.pauser.active  # until this phase's first step is done
        paused_here = False
        self._event("phase_started", phase=ph.index, start_step=work.start_step, end_step=ph.end_step,
                    layers=list(ph.layers), nproc=ph.nproc, pid=proc.pid,
                    restore=str(work.restore) if work.restore else None, prewarmed=group.prewarmed)
        tick = self.progress(self.run_dir, ph, work.start_step) if self.progress else (lambda: None)
        forwarded_at: float | None = None
        signalled: set[int] = set()
        try:
            while proc.poll() is None:
                tick()
                done = max([done, *(m["step"] for m in steps.new() if m.get("phase") == ph.index and "loss" in m)])
                late = time.time() - group.t_start > self.pauser.limit
                if switching and (done > work.start_step or late):
                    switching = False
                    self.pauser.resume("limit" if done == work.start_step else "first_step")
                    if ahead:
                        self._prewarm_ahead(pending, work)
                if self.pauser.overdue():
                    self.pauser.resume("limit")
                self.pauser.stop_new_ranks()
                if not switching and not paused_here and done >= ph.end_step - 1:
                    self.pauser.pause(pending[1:])
                    paused_here = True
                if self.stop_signal is not None:
                    if forwarded_at is None:
                        forwarded_at = time.time()
                        self._event("stop_requested", phase=ph.index, signal=self.stop_signal)
                    # Ranks catch SIGTERM, finish their step and write a checkpoint. Launchers do
                    # not forward it, so it goes to every rank directly, also to late starters.
                    ranks = [p for p in procs.recorded(phase_dir, "rank-") if p.pid not in signalled]
                    procs.signal_all(ranks, signal.SIGTERM)
                    signalled.update(p.pid for p in ranks)
                    if time.time() - forwarded_at > grace:
                        break
                time.sleep(0.02)
            if forwarded_at is not None:
                # The launcher may be gone while its ranks still write their checkpoint.
                psutil.wait_procs(procs.recorded(phase_dir, "rank-"), timeout=max(0.0, forwarded_at + grace - time.time()))
            tick()
        finally:
            pids = {p.pid for p in procs.recorded(phase_dir)}
            killed = procs.reap(phase_dir, proc.pid, grace=grace if forwarded_at is None else 1.0)
            if proc.poll() is None:
                proc.kill()
            rc = self.groups.wait(proc, grace)
            self.groups.close_go(group)
            self.pauser.resume("its_turn", pending[:1])  # the next phase is never kept paused
        t_gone = time.time()
        self.groups.clean_up(group)
        if killed:
            self._event("killed", phase=ph.index, pids=killed)
        group.pids = pids
        records = {**self._records(phase_dir), **getattr(proc, "times", {}), "t_gone": t_gone}
        end = self.run_dir / "checkpoints" / f"step-{ph.end_step:08d}"
        if rc == 0 and not verify_checkpoint(end, checksums=False):
            # Journaled by _after_switch, once the next phase has its go and the checkpoint is durable.
            self.verified.add(end)
            group.records, group.end = records, end
            return
        self._abort(pending)
        if self.stop_signal is not None:
            kept, manifest, _ = newest_valid(self.run_dir, checksums=False)
            step = manifest.global_step if manifest else 0
            self._event("preempted", phase=ph.index, step=step, signal=self.stop_signal, rc=rc)
            raise Preempted(f"preempted by signal {self.stop_signal} in phase {ph.index}; kept: the checkpoint at "
                            f"step {step} ({kept}); run the same command again to resume" if kept else
                            f"preempted by signal {self.stop_signal} in phase {ph.index} before any checkpoint; "
                            "run the same command again to start over")
        who, log, reasons = self.groups.failure(group, rc)
        if rc == 0:
            who += f", but its checkpoint {end} is missing or incomplete"
        steps = f"steps {work.start_step}-{ph.end_step - 1}"  # numbered as plan numbers them
        self._event("phase_failed", phase=ph.index, rc=rc, log=str(log), reason="; ".join([who, *reasons]),
                    reasons=reasons)
        why = "".join(f"\n  {r}" for r in reasons)
        raise PhaseFailed(f"phase {ph.index} ({steps}, layers {list(ph.layers)}) failed: {who}; "
                          f"earlier checkpoints are intact.{why}\nlast lines of {log}:\n{log_tail(log)}")

    def _records(self, phase_dir: Path) -> dict:
        try:
            return json.loads((phase_dir / "records.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def _retain(self, protect: set[Path]) -> None:
        """Keeps the newest keep_last checkpoints and everything they still need; removes the rest.

        ``protect``: checkpoints a pre-warmed successor may still be reading.
        """
        keep_last = self.loaded.schedule.checkpoint.keep_last
        valid = [c for c in list_checkpoints(self.run_dir) if not verify_checkpoint(c, checksums=False)]
        kept = valid[-keep_last:]
        try:
            needed = needed_by(self.run_dir, kept + sorted(protect))
        except CheckpointError as e:  # a damaged older checkpoint: keep everything rather than guess
            self._event("retention_skipped", reason=str(e))
            return
        for ckpt in valid:
            if ckpt not in needed:
                trash = ckpt.with_name(f".tmp-removing-{ckpt.name}")
                os.replace(ckpt, trash)
                shutil.rmtree(trash)
                self._event("checkpoint_removed", path=str(ckpt))


def resume_point(run_dir: Path, given: Path) -> Path:
    """The checkpoint --resume-from names, checked before anything is written: one of this run's,
    whole (checksums), and so are the layer files it builds on."""
    ckpt = Path(given).resolve()
    if not (run_dir / SCHEDULE_COPY).is_file():
        raise ScheduleError(f"--resume-from: {run_dir} holds no run to resume")
    if ckpt.parent != checkpoints_dir(run_dir).resolve() or not is_checkpoint_dir(ckpt):
        raise ScheduleError(f"--resume-from: expected a checkpoint of this run "
                            f"({checkpoints_dir(run_dir)}/step-NNNNNNNN), got {given}")
    try:
        faults = [f for src in sorted({ckpt, *layer_sources(run_dir, ckpt).values()}) for f in verify_checkpoint(src)]
    except CheckpointError as e:
        faults = [str(e)]
    if faults:
        raise ScheduleError(f"--resume-from: {given} is not whole:\n  " + "\n  ".join(faults))
    return checkpoints_dir(run_dir) / ckpt.name


def run_schedule(loaded: LoadedSchedule, **kw) -> None:
    """Runs (or resumes) a schedule; raises a RelayerError subclass on failure."""
    try:
        Runner(loaded, **kw).run()
    except OSError as e:
        raise RelayerError(f"{loaded.output_dir}: {e}") from e
