"""A phase's processes, from start to confirmed gone: spawning (as a launcher process, or forked by
the run's fork server), the go of a pre-warmed group, and taking groups down.

The channels are FIFOs in the run directory, mode 0600: fork requests to the fork server
(``RunDir.zygote_fifo``) and each pre-warmed phase's go (``PhaseDir.go``), framed as
``launch.contract.channels`` says. This process holds each FIFO open, so a reader sees EOF when it dies.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from launch.contract.channels import EARLY, FORK_REQUESTS, FORK_SERVER, FORK_SERVER_START, GO, PHASE_LAUNCHER, python_m
from launch.contract.files import RANK, UNRECORDED, Answer, PhaseDir, RunDir, read_reasons
from launch.contract.spec import PhaseSpec
from orchestrator import procs
from orchestrator.errors import PhaseFailed
from orchestrator.nodes import silent_ranks
from orchestrator.schedule import LaunchSection, Phase
from shard_tools.files import describe, open_append, open_regular, write_atomic
from shard_tools.store import Checkpoints

LOG_TAIL = 20


@dataclass(frozen=True)
class Work:
    """What to run next: a phase from a global step, restoring from a checkpoint (or the base)."""

    phase: Phase
    start_step: int
    restore: Path | None


class ForkedProc:
    """A phase whose ranks the zygote forked: the Popen calls the supervisor uses, from the exit
    files the zygote writes (the ranks are its children, not ours)."""

    def __init__(self, phase_dir: Path, nproc: int, zygote: subprocess.Popen):
        self.phase_dir, self.nproc, self.zygote = phase_dir, nproc, zygote
        self.files = PhaseDir(phase_dir)
        self.pid: int | None = None
        self.returncode: int | None = None
        self.server_rc: int | None = None
        """The fork server's exit code, where its end (not a rank's) ended the group."""
        self.times: dict[str, float] = {}
        """When the last rank was reaped by the zygote (``t_reaped``) and that was seen here (``t_seen``)."""

    def poll(self) -> int | None:
        if self.returncode is None:
            exits = [e for e in map(self.files.read_exit, range(self.nproc)) if e is not None]
            codes, reaped = [e.rc for e in exits], [e.time for e in exits]
            if len(codes) == self.nproc or any(codes):
                # A failed rank ends the group: the others may wait on it in a collective forever.
                self.returncode = next((c for c in codes if c != 0), 0)
                self.times = {"t_reaped": max(reaped), "t_seen": time.time()}
            elif self.zygote.poll() is not None:  # its children die with it (parent-death signal)
                self.returncode = -signal.SIGKILL
                self.server_rc = self.zygote.returncode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                return None
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        procs.signal_all(procs.recorded(self.phase_dir, RANK), signal.SIGKILL)


@dataclass
class Group:
    """One phase's process group, from its launcher's start until all of it is gone."""

    work: Work
    phase_dir: Path
    proc: subprocess.Popen | ForkedProc
    log_path: Path
    t_start: float
    """When it started (the wall clock: its records' times are compared with it), or got its go."""
    go_fd: int | None
    world: int
    port: int
    """The group's MASTER_PORT."""
    preload: Path | None = None
    """A pre-warmed group's weights as of this checkpoint, read before its go."""
    prewarmed: bool = False
    since: float = field(default_factory=time.monotonic)
    """``t_start`` on the monotonic clock, for durations a step of the wall clock must not change."""
    offers: bool = False
    """At its end it offers its state to its successor (``launch.handover``) before it writes."""
    takes: bool = False
    """Pre-warmed to take its predecessor's state over at its go (``launch.handover``)."""
    pids: set[int] = field(default_factory=set)
    records: dict = field(default_factory=dict)
    end: Path | None = None
    """The phase-end checkpoint, committed by the group, not yet durable and journaled."""
    before: Path | None = None
    """Where it takes its predecessor's state over: the checkpoint the predecessor started from,
    which its go reads (the layers trained since its preload)."""


class PhaseProcesses:
    """Starts, releases and takes down phase groups for one run directory; owns the fork server."""

    def __init__(self, run_dir: Path, launch: LaunchSection, event: Callable[..., None],
                 spec_of: Callable[[Work, Path], PhaseSpec]):
        self.run_dir, self.launch, self.event, self.spec_of = run_dir, launch, event, spec_of
        self.files = RunDir(run_dir)
        self.zygote: subprocess.Popen | None = None
        self.early: subprocess.Popen | None = None
        """A fork server started before the run's first spec (``start_early``), importing meanwhile."""
        self.early_out: IO[bytes] | None = None
        """What the early fork server printed before it was told its log."""
        self.zygote_fd = -1
        self.holder: ForkedProc | None = None
        """The holder of the model's weights (``launch.resident``), forked with the first phase."""
        self.stopped: set[int] = set()
        """Fork servers this process ended (their end is no failure of theirs)."""

    def start(self, work: Work, prewarm: bool) -> Group:
        """Starts the processes of ``work`` in the phase's directory, emptied of what an earlier
        attempt at it left; its spec is built (and so validated) first."""
        files = self.files.phase(work.phase.index)
        spec = self.spec_of(work, files.path)
        files.path.mkdir(parents=True, exist_ok=True, mode=0o750)
        files.clear()
        return self.spawn(work, files, spec, prewarm)

    def spawn(self, work: Work, files: PhaseDir, spec: PhaseSpec, prewarm: bool) -> Group:
        """Starts one phase's processes: forked by the fork server, or a launcher in a session of
        its own. Pre-warmed, they prepare and wait for their go (``go``); otherwise they train from
        ``work.restore`` at once."""
        ph = work.phase
        go_fd = None
        if prewarm:
            files.go.unlink(missing_ok=True)
            os.mkfifo(files.go, 0o600)
            # Held open read-write: ranks can open it at once, and see EOF if this process dies.
            go_fd = os.open(files.go, os.O_RDWR | os.O_NONBLOCK)
            spec = spec.changed(prewarm=True, restore=None, go_fifo=str(files.go),
                                preload=str(work.restore) if work.restore else None)
        else:  # started now, it has no predecessor alive to take from
            spec = spec.changed(handover=spec.handover.model_dump() | {"take": False})
        # Not fsynced: only these processes read it, and an fsync here could wait seconds behind a
        # finished phase's checkpoint being made durable (``orchestrator.commit``).
        write_atomic(files.spec, spec.model_dump_json(indent=1), durable=False)
        zygote = self.fork_server(files.spec)
        if zygote is not None and spec.resident is not None and self.holder is None:
            self.holder = self._hold(spec, work, zygote)
        if zygote is not None:
            os.write(self.zygote_fd, FORK_REQUESTS.encode(spec=str(files.spec), nproc=ph.nproc))
            proc: subprocess.Popen | ForkedProc = ForkedProc(files.path, ph.nproc, zygote)
        else:
            with open(open_append(files.log), "ab") as log:
                proc = subprocess.Popen(python_m(PHASE_LAUNCHER, str(files.spec)), stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        return Group(work=work, phase_dir=files.path, proc=proc, log_path=files.log, t_start=time.time(),
                     go_fd=go_fd, world=ph.nproc * self.launch.nnodes, port=spec.master_port,
                     preload=work.restore if prewarm else None, offers=spec.handover.offer,
                     takes=spec.handover.take)

    def _hold(self, spec: PhaseSpec, work: Work, zygote: subprocess.Popen) -> ForkedProc:
        """Forks the holder of the model's weights (``launch.resident``), one per rank, before the
        run's first phase: the base model with the layers of ``work.restore`` in (the run's start)."""
        files = self.files.resident
        shutil.rmtree(files.path, ignore_errors=True)  # an earlier orchestrator's
        files.path.mkdir(mode=0o700, parents=True)
        held = spec.changed(holds=True, phase_dir=str(files.path), prewarm=False, go_fifo=None, preload=None,
                            restore=str(work.restore) if work.restore else None, handover={})
        write_atomic(files.spec, held.model_dump_json(indent=1), durable=False)
        os.write(self.zygote_fd, FORK_REQUESTS.encode(spec=str(files.spec), nproc=work.phase.nproc))
        self.event("holder_started", nproc=work.phase.nproc, restore=held.restore)
        return ForkedProc(files.path, work.phase.nproc, zygote)

    def check_holder(self) -> None:
        """A PhaseFailed once the holder of the model's weights has ended before the run: the phases
        that mapped its block keep it until they end, but no later phase could map it."""
        holder = self.holder
        if holder is None or holder.poll() is None or holder.zygote.pid in self.stopped:
            return
        files = self.files.resident
        reasons = files.error_reasons()
        pids = [r.pid for r in files.pid_records()]
        self.event("holder_failed", how=exit_text(holder.returncode), pids=pids, reasons=reasons)
        why = "".join(f"\n  {r}" for r in reasons)
        raise PhaseFailed(f"the holder of the model's weights (launch.resident, pid {', '.join(map(str, pids))}) ended "
                          f"{exit_text(holder.returncode)}; earlier checkpoints are intact: run the same command "
                          f"again to resume.{why}\nlast lines of {files.log}:\n{log_tail(files.log)}")

    def forks(self) -> bool:
        """Whether this run's phases are forked by a fork server: one-node local runs with prewarm on."""
        launch = self.launch
        return launch.prewarm and launch.launcher == "local" and launch.nnodes == 1

    def start_early(self) -> None:
        """Starts the fork server before the run's first spec exists (``launch.zygote --early``): it
        imports torch, DeepSpeed and transformers (seconds) while the schedule's data is prepared
        and the run directory made. Unused, it goes with ``stop_fork_server``."""
        if self.forks() and self.early is None and self.zygote is None:
            # Its output, until it is told its log, goes to a file of no name: where it dies first,
            # the journal says how (``_started_early``).
            self.early_out = tempfile.TemporaryFile()
            self.early = subprocess.Popen(python_m(FORK_SERVER, EARLY), stdin=subprocess.PIPE,
                                          stdout=self.early_out, stderr=self.early_out,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def fork_server(self, spec_path: Path) -> subprocess.Popen | None:
        """The run's fork server (``launch.zygote``), started on first use (the early one, where it
        lives), for one-node local runs with prewarm on; None where phases start as launcher processes."""
        if not self.forks():
            return None
        if self.zygote is None:
            fifo = self.files.zygote_fifo
            fifo.unlink(missing_ok=True)
            os.mkfifo(fifo, 0o600)
            self.zygote_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
            self.files.zygote_error.unlink(missing_ok=True)  # an earlier orchestrator's
            self.zygote = self._started_early(spec_path, fifo) or self._spawn_fork_server(spec_path, fifo)
            self.event("zygote_started", pid=self.zygote.pid, early=self.zygote is self.early)
            self.early = None
            self._early_output()
        return self.zygote

    def _started_early(self, spec_path: Path, fifo: Path) -> subprocess.Popen | None:
        """The early fork server, told where to serve; None where there is none or it died."""
        early = self.early
        if early is None:
            return None
        if early.poll() is not None:  # replaced by one started as before; the journal says why
            self.event("zygote_early_died", pid=early.pid, how=exit_text(early.returncode), output=self._early_output())
            return None
        try:
            early.stdin.write(FORK_SERVER_START.encode(spec=str(spec_path), fifo=str(fifo), log=str(self.files.zygote_log)))
            early.stdin.close()
        except OSError:  # it died meanwhile
            self._end(early)
            return None
        return early

    def _spawn_fork_server(self, spec_path: Path, fifo: Path) -> subprocess.Popen:
        self._end(self.early)
        with open(open_append(self.files.zygote_log), "ab") as log:
            return subprocess.Popen(python_m(FORK_SERVER, str(spec_path), str(fifo)),
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def _early_output(self, tail: int = 2000) -> str:
        """The last ``tail`` characters the early fork server printed; the file is closed after."""
        out, self.early_out = self.early_out, None
        if out is None:
            return ""
        with out:
            out.seek(max(0, out.seek(0, os.SEEK_END) - 4 * tail))
            return out.read().decode(errors="replace")[-tail:]

    @staticmethod
    def _end(proc: subprocess.Popen | None) -> None:
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def stop_fork_server(self) -> None:
        self._end(self.early)  # never used: the run ended before its first phase
        self.early = None
        self._early_output()
        if self.zygote is None:
            return
        self.stopped.add(self.zygote.pid)
        self._end(self.zygote)  # the holder with it (its process group, and its parent-death signal)
        self.holder = None
        os.close(self.zygote_fd)
        self.files.zygote_fifo.unlink(missing_ok=True)
        self.zygote = None

    def wait(self, proc: subprocess.Popen | ForkedProc, timeout: float) -> int:
        """The exit code. A forked group with a rank the zygote has not reported (not forked yet,
        or still going) is ended by ending the zygote and everything it forked."""
        if isinstance(proc, subprocess.Popen):
            return proc.wait()
        rc = proc.wait(timeout)
        if rc is None:
            self.stop_fork_server()
            rc = proc.wait()
        return rc

    def failure(self, group: Group, rc: int) -> tuple[str, Path, list[str]]:
        """Which process of a failed group ended it and how, its log, and the reasons left in
        errors files: the fork server's where it died (nothing was forked, or its ranks died with
        it), else the group's own (a rank or the launcher, all logging to worker.log)."""
        proc = group.proc
        if isinstance(proc, ForkedProc) and proc.server_rc is not None and proc.zygote.pid not in self.stopped:
            how = exit_text(proc.server_rc) + (": it could not record how a rank ended (in the phase's exit/), "
                                               "and its ranks ended with it" if proc.server_rc == UNRECORDED else "")
            return (f"the fork server (launch.zygote, pid {proc.zygote.pid}) ended {how}",
                    self.files.zygote_log, read_reasons([self.files.zygote_error]))
        reasons = PhaseDir(group.phase_dir).error_reasons()
        if not isinstance(proc, ForkedProc):  # a launcher's ranks record how they end, unless killed
            reasons = [*silent_ranks(group.phase_dir, group.world), *reasons]
        return f"its processes ended {exit_text(rc)}", group.log_path, reasons

    def go(self, group: Group, restore: Path | None, handover: Path | None = None, defer: bool = False) -> None:
        """Tells a pre-warmed group its checkpoint; called only once its predecessor is gone, or,
        with ``handover`` (the predecessor's phase directory), once it has made its offers; ``defer``:
        where it takes the state over, the predecessor's end writes no checkpoint (``checkpoint.every_seconds``)."""
        record = GO.encode(restore=str(restore) if restore else None, handover=str(handover) if handover else None,
                           defer=defer)
        # The records wait in the pipe for ranks still preparing; the FIFO stays open until the
        # group is gone, since a pipe's data goes with its last open descriptor.
        for _ in range(group.world):
            os.write(group.go_fd, record)
        group.t_start, group.since = time.time(), time.monotonic()

    def decline(self, group: Group, reason: str) -> None:
        """Answers "not taken" to every rank of ``group`` still waiting for its successor's answer
        (the successor is gone, or not one to take over): it writes its checkpoint as without."""
        files = PhaseDir(group.phase_dir)
        answer = Answer(taken=False, by="orchestrator", reason=reason)
        ranks = [r for r in range(group.world) if files.write_answer(r, answer)]
        if ranks:
            self.event("handover_declined", phase=group.work.phase.index, ranks=ranks, reason=reason)

    def close_go(self, group: Group) -> None:
        if group.go_fd is not None:
            os.close(group.go_fd)
            group.go_fd = None
            PhaseDir(group.phase_dir).go.unlink(missing_ok=True)

    def abort(self, pending: list[Group]) -> None:
        """Takes pre-warmed groups down (their predecessor failed or stopped, or the plan moved on)."""
        while pending:
            self._abort_one(pending.pop())

    def _abort_one(self, group: Group) -> None:
        if group.proc.returncode is None:
            killed = procs.reap(group.phase_dir, group.proc.pid, grace=1.0)
            self.wait(group.proc, 1.0)
            if killed:
                self.event("successor_stopped", phase=group.work.phase.index, pids=killed)
        self.close_go(group)
        self.clean_up(group)

    def clean_up(self, group: Group) -> None:
        """What a group's processes leave once gone: their temporaries in the checkpoints folder
        (prepared files, a checkpoint cut off mid-write), DeepSpeed's shared-memory buffers, and
        the bytes it offered through the host transport (``launch.handover``)."""
        for path in Checkpoints(self.run_dir).remove_temporaries_of(procs.recorded_pids(group.phase_dir)):
            self.event("stray_removed", path=str(path))
        for blob in PhaseDir(group.phase_dir).blobs():
            blob.unlink(missing_ok=True)
        procs.remove_comm_buffers(group.port)


def exit_text(rc: int) -> str:
    """How a process ended, after "ended": "with exit code 1", "by signal SIGKILL"."""
    if rc < 0:
        try:
            return f"by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"by signal {-rc}"
    return f"with exit code {rc}"


def log_tail(path: Path, lines: int = LOG_TAIL) -> str:
    """The last lines of a log, or a line saying why there are none."""
    try:
        with open(open_regular(path), errors="replace") as f:  # never blocked on a FIFO
            return "".join(deque(f, maxlen=lines)) or "(empty)\n"
    except OSError as e:
        return f"(none: {describe(e)})\n"
