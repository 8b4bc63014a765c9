"""What every phase process does about its own life: record its pid, die with its parent, and
never outlive the orchestrator (which may have been SIGKILLed and so could not clean up)."""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from launch.contract.channels import GO
from launch.contract.files import DUMP_STACKS, PhaseDir, rank_name
from launch.contract.pids import started

PR_SET_PDEATHSIG = 1


def gc_collections() -> int:
    """Garbage collections of this process so far, every generation."""
    return sum(g["collections"] for g in gc.get_stats())


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def fork_dying_with_parent(sig: int = signal.SIGKILL) -> int:
    """``os.fork``, returning only once the child's parent-death signal is set (0 in the child).

    Whoever forks records the child's pid next, and a recorded rank may be paused (SIGSTOP,
    ``orchestrator.quiet``) at once: a rank paused before it set the signal itself outlived a
    SIGKILLed orchestrator, stopped, for good. A child whose parent is gone already exits."""
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        set_parent_death_signal(sig)
        if os.getppid() != parent:
            os._exit(1)
        os.write(w, b"1")
        os.close(w)
        return 0
    os.close(w)
    try:
        os.read(r, 1)  # a byte once it is set; end of file where the child died first
    finally:
        os.close(r)
    return pid


def record_pid(phase_dir: Path, name: str) -> None:
    """Records this process as ``name`` in the phase directory, so the orchestrator can reap it."""
    PhaseDir(phase_dir).record_pid(name, os.getpid(), started(os.getpid()), node_name())


def node_name() -> str:
    """This process's node: SLURM's name for it in a job (nodes may share a host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _watch(pid: int, since: float, interval: float) -> None:
    while True:
        try:
            alive = started(pid) == since
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(interval)


def watch_orchestrator(pid: int, interval: float = 0.5) -> None:
    """A daemon thread that SIGKILLs this process once the orchestrator process is gone (its pid
    gone, or another process's: matched on ``started``, which no step of the clock moves)."""
    try:
        since = started(pid)
    except psutil.NoSuchProcess:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    threading.Thread(target=_watch, args=(pid, since, interval), daemon=True, name="orchestrator-watch").start()


def dump_stacks_on_signal(phase_dir: Path, rank: int) -> None:
    """On DUMP_STACKS, every thread's Python stack is appended to the rank's stacks file, from C:
    also while the interpreter is stuck in a call that never returns (a collective, a write)."""
    stacks = PhaseDir(phase_dir).stacks
    stacks.mkdir(exist_ok=True)
    faulthandler.register(DUMP_STACKS, file=open(stacks / f"{rank_name(rank)}.txt", "a"), all_threads=True)


def guard_process(phase_dir: Path, rank: int, orchestrator_pid: int | None) -> None:
    set_parent_death_signal()
    dump_stacks_on_signal(phase_dir, rank)
    record_pid(phase_dir, rank_name(rank))
    if orchestrator_pid is not None:
        watch_orchestrator(orchestrator_pid)


def wait_for_go(fifo: Path, idle: Callable[[], None] = lambda: None) -> dict:
    """Blocks until the orchestrator writes a go record to ``fifo`` (one per rank), calling
    ``idle`` meanwhile; EOF means the orchestrator is gone, and so this process goes too."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        go = GO.read(fd, idle)
    finally:
        os.close(fd)
    if go is None:
        raise SystemExit(f"{fifo}: closed before the go: the orchestrator is gone")
    return go


BACKGROUND_NICE = 10
"""How much lower than the priority it inherited a pre-warmed phase prepares at."""
_inherited: int | None = None


def background(on: bool) -> bool:
    """Lowers (``on``) the CPU priority of every thread of this process by BACKGROUND_NICE below the
    one it inherited, or restores exactly that one; False where it could not be restored and so is
    not lowered (no CAP_SYS_NICE and RLIMIT_NICE does not reach back to it).

    A pre-warmed phase prepares in the background, so that its CPU work yields to the processes on
    the switch's critical path (the finished phase's write, the starting phase's load); at its go
    it is back at the priority the run was started with (``nice -n 19 orchestrator run`` trains at 19).
    """
    import resource

    global _inherited
    if on:
        inherited = os.getpriority(os.PRIO_PROCESS, 0)
        # RLIMIT_NICE r lets an unprivileged process lower its nice value down to 20 - r.
        if not (os.geteuid() == 0 or 20 - resource.getrlimit(resource.RLIMIT_NICE)[0] <= inherited):
            return False
        _inherited, value = inherited, min(19, inherited + BACKGROUND_NICE)
    elif _inherited is None:
        return False
    else:
        value = _inherited
    for tid in os.listdir("/proc/self/task"):  # Linux: niceness is per thread
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), value)
        except (ProcessLookupError, PermissionError):
            continue
    return True


class PhaseError(Exception):
    """A fault whose message says all there is to say (a non-finite loss, say): reported as one
    line, without a traceback."""


def report_error(phase_dir: Path, rank: int, error: BaseException) -> None:
    """Leaves the reason a rank failed where the orchestrator looks for it."""
    PhaseDir(phase_dir).write_error(rank, error)
