"""Finding a stalled phase and what its ranks were doing.

A phase progresses when it logs a step or a stage, or when a checkpoint being written grows. One
that does none of these for ``launch.stall_seconds`` is stalled (a collective whose peer is gone,
a write blocked on a full disk, a rendezvous that never completes); where a phase legitimately
goes quiet for longer (its start-up and first step, its checkpoint writes, a handed-over write) it
gets ``QUIET_ALLOWANCE`` times that, and until its first stage (its processes import torch and
DeepSpeed, or wait for a fork server that does) at least ``IMPORT_SECONDS``. Before the phase is ended, every rank appends all its
threads' Python stacks to its stacks file (``launch.procs.dump_stacks_on_signal``), and, where
py-spy is installed, its native frames too.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import psutil

from launch.contract.files import DUMP_STACKS, RANK, PhaseDir
from orchestrator import procs
from orchestrator.space import NEARLY_FULL
from shard_tools.store import Checkpoints

QUIET_ALLOWANCE = 4
IMPORT_SECONDS = 300.0
DUMP_SECONDS = 3.0
"""How long the ranks get to write their stacks."""
NATIVE_SECONDS = 30.0
"""How long py-spy gets for all of them."""
SHOWN_FRAMES = 6


class Watchdog:
    """The time of a phase's last progress; ``moved`` is told of every step and stage."""

    started = False
    """A stage or a step was seen: the imports are done."""

    def __init__(self, limit: float, run_dir: Path):
        self.limit = limit
        self.store = Checkpoints(run_dir)
        self.written = self._written()
        self.at = time.monotonic()

    def moved(self) -> None:
        self.at, self.started = time.monotonic(), True

    def stalled(self, quiet: bool) -> float | None:
        """Seconds since the last progress once they are over the limit (``QUIET_ALLOWANCE`` times
        it where ``quiet``), else None. Checkpoint bytes are counted only then."""
        idle = time.monotonic() - self.at
        allowance = self.limit * (QUIET_ALLOWANCE if quiet or not self.started else 1)
        if idle <= (allowance if self.started else max(allowance, IMPORT_SECONDS)):
            return None
        written = self._written()
        if written != self.written:
            self.written, self.at = written, time.monotonic()
            return None
        return idle

    def _written(self) -> int:
        """Bytes in the checkpoints being written (their temporaries)."""
        total = 0
        for tmp in self.store.stray_temporaries():
            for f in tmp.rglob("*") if tmp.is_dir() else [tmp]:
                try:
                    total += f.stat().st_size
                except OSError:  # renamed into place meanwhile
                    continue
        return total


def dump_stacks(phase_dir: Path) -> tuple[Path, str]:
    """Has every live rank of the phase append its stacks to its file (and py-spy, where there,
    write its native ones next to it); returns the folder and rank 0's innermost frames."""
    folder = PhaseDir(phase_dir).stacks
    ranks = procs.recorded(phase_dir, RANK)
    before = {f: f.stat().st_size for f in folder.glob(f"{RANK}*.txt")}
    procs.signal_all(ranks, DUMP_STACKS)
    end = time.monotonic() + DUMP_SECONDS
    while time.monotonic() < end and sum(f.stat().st_size > n for f, n in before.items()) < len(ranks):
        time.sleep(0.05)
    native = _native(ranks, folder)
    first = folder / f"{RANK}0.txt"
    dump = first.read_text(errors="replace")[before.get(first, 0):] if first.exists() else ""
    if dump.strip():
        return folder, innermost(dump)
    if not ranks:
        return folder, "  (no rank had started)"
    # Seen on a full disk: the ranks' dumps could not be written there; py-spy's came back in memory.
    free = shutil.disk_usage(folder).free
    why = f"; that file system has {free >> 20} MiB free" if free < NEARLY_FULL else ""
    shown = "\n".join(native.splitlines()[:3 * SHOWN_FRAMES]) if native else "  (py-spy is not installed)"
    return folder, f"  (rank 0 wrote no stacks within {DUMP_SECONDS:g} s{why}; py-spy of it:)\n{shown}"


def innermost(dump: str) -> str:
    """The innermost frames of the thread that took the signal (the main one) in a faulthandler dump."""
    blocks = dump.strip().split("\n\n")
    current = next((b for b in blocks if b.startswith("Current thread")), blocks[0])
    return "\n".join(current.splitlines()[: SHOWN_FRAMES + 1])


def _native(ranks: list[psutil.Process], folder: Path) -> str:
    """py-spy's dumps with native frames, py-spy-PID.txt, all at once and for a bounded time;
    returns the first rank's (kept in memory too: the folder's disk may be full)."""
    spy = shutil.which("py-spy")
    if spy is None or not ranks:
        return ""
    running = [subprocess.Popen([spy, "dump", "--native", "--pid", str(p.pid)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for p in ranks]
    end, dumps = time.monotonic() + NATIVE_SECONDS, []
    for p, rank in zip(running, ranks):
        try:
            out = p.communicate(timeout=max(0.0, end - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0]
        dumps.append(out)
        try:
            (folder / f"py-spy-{rank.pid}.txt").write_text(out)
        except OSError:
            pass  # a full disk: the terminal still shows rank 0's
    return dumps[0]
