"""The start of a phase's process group, bounded by ``launch.rendezvous_seconds``: by then its
processes have met, or each one still waiting fails, naming the address it waited at.

Unbounded, a start waits as long as torch's process-group timeout (30 minutes for gloo) before it
says anything: under a two-node SLURM allocation whose node names did not resolve, phase 0 sat at
"starting the process group" for over 10 minutes. Only the start is bounded here; the collectives
keep torch's timeout (a rank may wait minutes in one while rank 0 writes a checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Iterator

from launch import procs


@contextlib.contextmanager
def bounded(seconds: float, phase_dir: Path, rank: int) -> Iterator[None]:
    """Ends this process with exit code 1, its reason left for the orchestrator, where the block
    (the process group's start) takes longer than ``seconds``."""
    met = threading.Event()

    def expire() -> None:
        if met.wait(seconds):
            return
        error = procs.PhaseError(unmet(seconds, rank))
        procs.report_error(phase_dir, rank, error)
        print(f"rank {rank}: {error}", file=sys.stderr, flush=True)
        os._exit(1)  # the main thread is stuck in torch's C++ and would not see an exception

    threading.Thread(target=expire, daemon=True, name="rendezvous-bound").start()
    try:
        yield
    finally:
        met.set()


def unmet(seconds: float, rank: int) -> str:
    """Why a rank is still waiting to meet the others, as far as it can tell."""
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    try:
        socket.getaddrinfo(addr, port)
        why = "nothing answered there, or not every rank came: is it this job's rank 0, reachable from every node?"
    except (socket.gaierror, UnicodeError) as e:
        why = f"{addr} does not resolve on this node ({getattr(e, 'strerror', None) or e})"
    return (f"the process group did not start within {seconds:g} s (launch.rendezvous_seconds): rank {rank} "
            f"of {os.environ.get('WORLD_SIZE', '?')} on node {procs.node_name()} waited at {addr}:{port}, "
            f"the rendezvous: {why}; launch.master_addr names an address of rank 0's node that every node resolves")
