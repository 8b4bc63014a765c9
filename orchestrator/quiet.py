"""Quiet switches: the phases still preparing further ahead are paused while a phase switches.

A pre-warmed phase prepares for seconds (device context, process group, a warm-up step), so with
short phases several prepare at once, and they share the device and the host with the switch: on
the H200 every piece of a switch they overlapped took three times as long (the finished phase's
gather, the next phase's engine build; ``benchmarks/results/2026-11-29-nvidia-h200-v3``). Lowering
their CPU priority changed nothing. So the orchestrator stops their ranks (SIGSTOP) from the
running phase's last step until the next phase has finished its first step, and lets them go on
(SIGCONT) then, or after ``launch.pause_preparing_seconds`` whatever happens. The next phase itself
is never paused, and a rank that holds a file lock when it is stopped goes on at once (``lock_holders``):
the next phase may wait on it. The phases waiting pre-warmed warm up one at a time under an flock
(``launch.prepare``), and on an H100 a successor still preparing waited the whole 30 s for a paused
phase that held it (benchmarks/results/2026-12-07-issue46-h100-misa, lisa-1.1b's first switch).

A paused process cannot notice anything, so nothing relies on it to: SIGKILL ends it where it
stands (its parent's death signal when the orchestrator dies; ``procs.reap``, which also sends
SIGCONT after SIGTERM so that a paused process can act on it).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable

import psutil

from launch.contract.files import RANK
from orchestrator import procs
from orchestrator.groups import Group


class Pauser:
    """The groups paused for the switch under way; at most one pause at a time."""

    def __init__(self, limit: float, event: Callable[..., None]):
        self.limit, self.event = limit, event
        self.paused: dict[int, tuple[Group, list[psutil.Process]]] = {}
        """Paused groups by phase index, with the ranks that were sent SIGSTOP."""
        self.since: float | None = None
        self.exempt: set[int] = set()
        """Ranks let go on in this pause: they held a file lock (``_free_lock_holders``)."""

    @property
    def active(self) -> bool:
        return self.since is not None

    def overdue(self) -> bool:
        return self.since is not None and time.monotonic() - self.since > self.limit

    def pause(self, groups: list[Group]) -> None:
        if self.limit <= 0 or self.active:
            return
        for g in groups:
            if g.proc.poll() is None:
                self.paused[g.work.phase.index] = (g, [])
        if self.paused:
            self.since = time.monotonic()
            self.stop_new_ranks()
            self.event("preparing_paused", phases=sorted(self.paused),
                       pids=sorted(p.pid for _, ranks in self.paused.values() for p in ranks))

    def stop_new_ranks(self) -> None:
        """SIGSTOP to the ranks of paused groups that were recorded since: a group started just
        before the pause may not have been forked yet (the fork server forks when it gets to it),
        and must not start preparing in the middle of the switch."""
        stopped = False
        for g, ranks in self.paused.values():
            known = {p.pid for p in ranks} | self.exempt
            new = [p for p in procs.recorded(g.phase_dir, RANK) if p.pid not in known]
            if new:
                procs.signal_all(new, signal.SIGSTOP)
                ranks.extend(new)
                stopped = True
        if stopped:
            self._free_lock_holders()

    def _free_lock_holders(self) -> None:
        """SIGCONT to the paused ranks that hold a file lock (stopped, none can take one more), and
        they stay out of the pause: another phase may wait for that lock."""
        holders = lock_holders()
        for g, ranks in self.paused.values():
            held = [p for p in ranks if p.pid in holders]
            if held:
                procs.signal_all(held, signal.SIGCONT)
                ranks[:] = [p for p in ranks if p.pid not in holders]
                self.exempt.update(p.pid for p in held)
                self.event("preparing_not_paused", phase=g.work.phase.index, pids=[p.pid for p in held],
                           reason="holds a file lock")

    def resume(self, reason: str, groups: list[Group] | None = None) -> None:
        """SIGCONT to ``groups`` (every paused one if None): the ranks stopped, and any recorded
        since."""
        chosen = [i for i, (g, _) in self.paused.items() if groups is None or any(g is x for x in groups)]
        if not chosen:
            return
        for i in chosen:
            g, ranks = self.paused.pop(i)
            procs.signal_all(ranks + procs.recorded(g.phase_dir, RANK), signal.SIGCONT)
        seconds = time.monotonic() - self.since
        if not self.paused:
            self.since = None
            self.exempt.clear()
        self.event("preparing_resumed", phases=sorted(chosen), reason=reason, seconds=round(seconds, 4))


def lock_holders() -> set[int]:
    """The pids that hold a file lock (flock, POSIX, OFD) now, from /proc/locks; a waiter's line
    ("N: -> FLOCK ...") is not a holder. Empty where it cannot be read."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return set()
    pids = set()
    for line in lines:
        fields = line.split()
        if len(fields) > 4 and fields[1] != "->" and fields[4].isdigit():
            pids.add(int(fields[4]))
    return pids
