"""Torch's threads per rank (``launch.threads``): OMP_NUM_THREADS honoured, else the cores free to
the run, measured while the rank switches in, divided among the node's ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

from launch.threads import TOO_SHORT, FreeCores, set_threads, told


def burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_omp_num_threads_is_honoured_where_set():
    assert told({"OMP_NUM_THREADS": "3"}) == 3
    assert told({"OMP_NUM_THREADS": "0"}) is None and told({"OMP_NUM_THREADS": "x"}) is None and told({}) is None
    assert FreeCores().threads(2, 8, {"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")


def test_busy_cores_leave_one_thread_and_never_more_than_it_had():
    """Seen: one process on a busy 2-core machine took 6.5 s a step with torch's 2 threads, 0.53 s
    with one. Here every core this process may use is kept busy by other processes."""
    cpus = len(os.sched_getaffinity(0))
    others = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus)]
    try:
        time.sleep(0.3)
        cores = FreeCores()
        burn(0.5)  # the rank's own work counts as its own, not as another's
        threads, why = cores.threads(1, 64, {})
    finally:
        for p in others:
            p.kill()
            p.wait()
    assert threads == 1, why
    assert "cores free" in why


def test_an_idle_machine_keeps_the_threads_it_had():
    cores = FreeCores()
    assert cores.threads(1, 2, {}) == (2, TOO_SHORT)
    time.sleep(0.2)
    threads, why = cores.threads(1, 1, {})
    assert threads == 1, why  # never more than it had


def test_a_switch_too_short_to_tell_is_measured_again_at_the_first_steps_end(monkeypatch):
    """A tiny model's switch takes less than the measure needs: the threads it had stayed for the
    whole phase, and one process kept torch's 2 threads on a 2-core machine a test suite kept busy
    (4.9 x slower steps than 2 processes of one thread). The first step's end measures again."""
    import torch

    class Timeline(dict):
        def add(self, **kw):
            self.update(kw)

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the tests' processes have it
    ph = SimpleNamespace(world=1, spec=SimpleNamespace(nnodes=1), timeline=Timeline(), cores=None)
    had = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    others = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus)]
    try:
        time.sleep(0.3)
        torch.set_num_threads(max(2, cpus))
        set_threads(ph, FreeCores())  # at once: too short
        assert ph.timeline["threads_why"] == TOO_SHORT and ph.cores is not None
        assert torch.get_num_threads() == max(2, cpus)
        burn(0.5)  # the first step
        set_threads(ph, ph.cores, "_after_first_step")
        assert torch.get_num_threads() == 1 == ph.timeline["threads_after_first_step"], ph.timeline
        assert "cores free" in ph.timeline["threads_why_after_first_step"] and ph.cores is None
    finally:
        torch.set_num_threads(had)
        for p in others:
            p.kill()
            p.wait()
