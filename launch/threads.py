"""Torch's threads in one rank: ``OMP_NUM_THREADS`` where set (per process, as torchrun reads
it), else the cores free to the run divided among the node's ranks, never more than it had (the
cores it may run on, divided among the fork server's ranks): on an idle machine nothing changes.

Free cores are measured while the rank switches in (from its go, or its start, to its first step):
the busy time of the CPUs it may run on, less this rank's own (and, ranks being alike, its
siblings'), is what other processes took. Seen on a busy 2-core machine: one process with torch's
two threads took 6.5 s a step, with one 0.53 s, bitwise the same weights, since OpenMP's threads
wait for each other at every operation and a busy core makes all of them wait.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import psutil

SHORTEST = 0.05
"""Seconds of switching under which the measure says nothing: the threads are left as they are until
the first step's end, and measured again then (``set_threads``)."""
TOO_SHORT = "too short a switch to measure the free cores"


def told(environ: Mapping[str, str] | None = None) -> int | None:
    """``OMP_NUM_THREADS`` where it is a positive whole number."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()  # os.environ as it is now
    return int(value) if value.isdigit() and int(value) > 0 else None


class FreeCores:
    """Started where the rank begins to switch in; ``threads`` once it is about to train."""

    def __init__(self) -> None:
        self.cpus = sorted(os.sched_getaffinity(0))
        self.t0, self.busy0, self.own0 = time.monotonic(), self._busy(), self._own()

    def _busy(self) -> float:
        per = psutil.cpu_times(percpu=True)
        return sum(sum(per[c]) - per[c].idle - getattr(per[c], "iowait", 0.0) for c in self.cpus if c < len(per))

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def free(self, ranks: int) -> float | None:
        """Cores free since the start, ``ranks`` of this node taking as much as this one; None
        where too little time passed to tell."""
        wall = time.monotonic() - self.t0
        if wall < SHORTEST:
            return None
        others = (self._busy() - self.busy0) - (self._own() - self.own0) * ranks
        return min(len(self.cpus), max(0.0, len(self.cpus) - max(0.0, others) / wall))

    def threads(self, ranks: int, current: int, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
        """(threads for this rank, why), from ``current`` (torch's now)."""
        if (n := told(environ)) is not None:
            return n, "OMP_NUM_THREADS"
        free = self.free(ranks)
        if free is None:
            return current, TOO_SHORT
        return (min(current, max(1, int(free + 0.5) // max(1, ranks))),
                f"{free:.1f} of {len(self.cpus)} cores free, {ranks} rank(s)")


def set_threads(ph, cores: FreeCores, where: str = "") -> None:
    """Torch's threads for the phase ``ph`` (``launch.record.Phase``) from ``cores``, in its records;
    where the switch was too short to tell, ``ph.cores`` keeps the measure for the first step's end
    (a tiny model's switch: on a 2-core machine running a test suite beside it, one process kept
    torch's 2 threads and stepped 4.9 x slower than 2 processes of one thread each)."""
    import torch

    threads, why = cores.threads(max(1, ph.world // ph.spec.nnodes), torch.get_num_threads())
    torch.set_num_threads(threads)
    ph.timeline.add(**{f"threads{where}": threads, f"threads_why{where}": why})
    ph.cores = cores if why == TOO_SHORT and not where else None
