"""Making sure no process of a phase survives it: every recorded pid, and the phase's session."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import psutil

from launch.contract.files import PhaseDir
from launch.contract.pids import started


def recorded(phase_dir: Path, prefix: str = "") -> list[psutil.Process]:
    """Live processes of the phase's pid records whose names start with ``prefix`` (``RANK`` for
    the ranks), matched on their start (``launch.contract.pids``): no pid reuse, no step of the clock."""
    out = []
    for rec in PhaseDir(phase_dir).pid_records(prefix):
        try:
            p = psutil.Process(rec.pid)  # first: psutil's handle stays this process's, whatever reuses the pid
            if started(rec.pid) == rec.started:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def recorded_pids(phase_dir: Path) -> set[int]:
    """Every pid ever recorded for the phase, alive or not."""
    return {rec.pid for rec in PhaseDir(phase_dir).pid_records()}


def drop_terminal() -> None:
    """Points stdout and stderr at /dev/null where they are a terminal (a character device: one
    hung up fails tcgetattr, so isatty no longer says so), as nohup does: once the terminal has
    closed, a write to it raises EIO. A file or a pipe keeps its output."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
            except OSError:
                continue
    finally:
        os.close(null)


COMM_BUFFER = "deepspeed_allreduce_buffer"


def remove_comm_buffers(port: int) -> list[Path]:
    """Removes what DeepSpeed's CPU comm op of the processes on ``port`` left in /dev/shm (its
    ranks unlink their buffers once all are mapped, but a rank killed before that cannot)."""
    gone = list(Path("/dev/shm").glob(f"{COMM_BUFFER}_{os.getuid()}_*_{port}_*"))
    for f in gone:
        f.unlink(missing_ok=True)
    return gone


def in_session(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.pid != os.getpid():
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return out


def phase_processes(phase_dir: Path, session: int | None) -> list[psutil.Process]:
    procs = {p.pid: p for p in recorded(phase_dir)}
    if session is not None:
        procs.update({p.pid: p for p in in_session(session)})
    return [p for p in procs.values() if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Waits up to ``timeout`` s until each of ``procs`` has exited (a zombie has: it holds no
    memory); returns those that have not. Children are reaped on the way."""
    deadline = time.monotonic() + timeout
    while True:
        psutil.wait_procs([p for p in procs if _alive(p)], timeout=0)  # reaps this process's own children
        left = [p for p in procs if _alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def reap(phase_dir: Path, session: int | None, grace: float) -> list[int]:
    """SIGTERM (and SIGCONT), up to ``grace`` seconds, SIGKILL; returns the pids that had to be stopped.

    Raises RuntimeError if any process is still alive after SIGKILL (it would hold device memory).
    """
    procs = phase_processes(phase_dir, session)
    if not procs:
        return []
    stopped = [p.pid for p in procs]
    signal_all(procs, signal.SIGTERM)
    signal_all(procs, signal.SIGCONT)  # a paused process (orchestrator.quiet) acts on SIGTERM only once continued
    _, alive = psutil.wait_procs(procs, timeout=grace)
    signal_all(alive, signal.SIGKILL)
    _, alive = psutil.wait_procs(alive, timeout=10)
    alive = [p for p in alive if _alive(p)]
    if alive:
        raise RuntimeError(f"processes {[p.pid for p in alive]} of {phase_dir} survived SIGKILL")
    return stopped



def end_session(proc: subprocess.Popen) -> None:
    """Ends a child started in a session of its own and everything it started there (the data
    tool's ``datasets.map`` workers): SIGKILL, then a wait until none of them is alive."""
    members = [p for p in in_session(proc.pid) if _alive(p)]
    signal_all(members, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    psutil.wait_procs([p for p in members if p.pid != proc.pid], timeout=10)
