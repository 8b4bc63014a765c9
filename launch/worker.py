"""The phase worker: one process of one phase. Run by a launcher, one per rank:

    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m launch.worker RUN_DIR/phases/phase-0000/spec.json

It builds the model as of the checkpoint it restores from (base weights, each layer's newest
trained weights, the head), freezes all but the head and the phase's layers, builds a fresh
DeepSpeed engine, injects the head's optimizer state (and, mid-phase, the body's), trains to the
phase's end and writes a checkpoint. It never outlives the orchestrator, and on SIGTERM / SIGINT /
SIGUSR1 it finishes the current step, writes a checkpoint and exits with PREEMPTED.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from launch import procs
from launch.spec import PhaseSpec

def main(argv: list[str]) -> int:
    # The deepspeed launcher adds --local_rank=N; LOCAL_RANK in the environment says the same.
    args = [a for a in argv[1:] if not a.startswith("--local_rank")]
    spec = PhaseSpec.read(args[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    procs.guard_process(Path(spec.phase_dir), rank, spec.orchestrator_pid)
    stop = {"signal": None}

    def _request_stop(signum, _frame):
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, _request_stop)
    from launch.phase import run_phase

    return run_phase(spec, rank, world, stop)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
