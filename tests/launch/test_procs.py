"""A phase process never outlives its orchestrator, even paused (#48)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

PAUSED_ORPHAN = r"""
import os, signal, sys, time
from launch.procs import fork_dying_with_parent

pid = fork_dying_with_parent()
if pid == 0:
    time.sleep(60)
    os._exit(0)
os.kill(pid, signal.SIGSTOP)  # paused as soon as forked, as the orchestrator pauses a recorded rank
print(pid, flush=True)
os._exit(0)  # its parent gone: a SIGKILLed orchestrator's fork server
"""


def test_a_rank_paused_as_soon_as_it_is_forked_dies_with_its_parent():
    """The fork server records a rank's pid as soon as it forks it, and the orchestrator may pause a
    recorded rank at once; one paused before it set its parent-death signal stayed stopped (state
    T, parent 1) after a SIGKILLed orchestrator, for good."""
    r = subprocess.run([sys.executable, "-c", PAUSED_ORPHAN], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"pid {pid} outlived its parent ({psutil.Process(pid).status()})")
        time.sleep(0.05)
