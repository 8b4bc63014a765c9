"""A process's identity: its pid and when it started, counted from the machine's boot.

psutil's ``create_time()`` is the start counted from boot *plus* the boot time, which Linux derives
from the wall clock (``btime`` in /proc/stat): every step of the clock (NTP, a virtual machine
restored from a snapshot, ``date -s``) moves it, and with it every process's create time. A rank
comparing its orchestrator's create time with the one it read at its start then took the
orchestrator for gone and SIGKILLed itself, nothing in its log (shown by stepping the clock,
``tests/orchestrator/test_clock.py``; the likely death of a phase in a CI run on a freshly forked
virtual machine), and the orchestrator no longer recognised the processes it had recorded. The start counted from boot (field 22 of /proc/PID/stat, in clock ticks) never moves.
"""

from __future__ import annotations

import os
import sys

import psutil

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def started(pid: int) -> float:
    """When process ``pid`` started, in seconds since the machine booted (Linux; elsewhere psutil's
    create time, which a step of the clock moves). psutil.NoSuchProcess where there is none."""
    if not sys.platform.startswith("linux"):
        return psutil.Process(pid).create_time()
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[19]) / _TICKS
