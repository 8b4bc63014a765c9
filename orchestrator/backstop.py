"""A stop always stops. The run ends on its own within a stop's grace (the supervisor forwards
the stop, waits ``launch.grace_seconds``, SIGKILLs what is left); this is for when the
orchestrator's main thread cannot get there: blocked in an fsync of the journal or of a checkpoint
on a full or slow disk, or waiting for a process in uninterruptible sleep. A thread learns of the
stop signal from the signal's wakeup fd, which the C handler writes even while the main thread is
in such a call; ``BACKSTOP_SECONDS`` after the grace it SIGKILLs every process of the run and
ends the orchestrator with exit 75, the checkpoints already there being the ones a rerun resumes
from.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

import psutil

from launch.contract.files import RunDir
from orchestrator import procs

BACKSTOP_SECONDS = 5.0
KILL_WAIT_SECONDS = 3.0
EXIT_PREEMPTED = 75


def arm(run_dir: Path, grace: float, signals: tuple[int, ...]) -> Callable[[], None]:
    """From now on, a stop signal gives the run ``grace + BACKSTOP_SECONDS``; returns what disarms
    it. Call from the main thread, with the signals' Python handlers installed."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    disarmed = threading.Event()
    threading.Thread(target=_watch, args=(read, set(signals), Path(run_dir), grace + BACKSTOP_SECONDS, disarmed),
                     daemon=True, name="stop-backstop").start()

    def disarm() -> None:
        signal.set_wakeup_fd(previous)  # before the reader goes: a signal's byte always has one
        disarmed.set()
        os.close(write)  # a thread still waiting for a signal reads the end of the pipe and returns

    return disarm


def _watch(fd: int, signals: set[int], run_dir: Path, seconds: float, disarmed: threading.Event) -> None:
    # The read end stays open until disarmed: a second signal's byte written to a pipe without a
    # reader would print a BrokenPipeError traceback from the handler (a second Ctrl-C did).
    with os.fdopen(fd, "rb", buffering=0) as wakeups:
        while not signals & set(got := wakeups.read(64)):
            if not got:
                return
        if disarmed.wait(seconds):
            return
    left = run_processes(run_dir)
    procs.signal_all(left, signal.SIGKILL)
    procs.wait_gone(left, timeout=KILL_WAIT_SECONDS)  # their memory is back before the exit says so
    print(f"stopping: the run did not end within {seconds:g} s of the stop signal; killed its processes "
          f"{sorted(p.pid for p in left)}; run the same command again to resume", file=sys.stderr, flush=True)
    os._exit(EXIT_PREEMPTED)


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every process the orchestrator started (and theirs), and every one a phase recorded."""
    found = {p.pid: p for p in psutil.Process().children(recursive=True)}
    for files in RunDir(run_dir).phase_dirs():
        found.update({p.pid: p for p in procs.recorded(files.path)})
    return list(found.values())
