"""The phase worker: one process of one phase. Run by a launcher, one per rank:

    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m launch.worker RUN_DIR/phases/phase-0000/spec.json

It builds the model as of the checkpoint it restores from (base weights, each layer's newest
trained weights, the head), freezes all but the head and the phase's layers, builds a fresh
DeepSpeed engine, injects the head's optimizer state (and, mid-phase, the body's), trains to the
phase's end and writes a checkpoint. It never outlives the orchestrator, and on SIGTERM / SIGINT /
SIGUSR1 / SIGHUP it finishes the current step, writes a checkpoint and exits with PREEMPTED.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from launch import procs
from launch.commands import rank_env_from_slurm
from launch.contract.files import PhaseDir
from launch.contract.spec import PhaseSpec


def main(argv: list[str], prebuilt: dict | None = None) -> int:
    """``prebuilt``: base models built before this process was forked (``launch.zygote``)."""
    spec = PhaseSpec.read(argv[1])
    if spec.launcher == "slurm":
        os.environ.update(rank_env_from_slurm(os.environ, spec.master_addr))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    same_host = spec.orchestrator_host in (None, socket.gethostname())
    procs.guard_process(Path(spec.phase_dir), rank, spec.orchestrator_pid if same_host else None)
    stop = {"signal": None}

    def _request_stop(signum, _frame):
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, _request_stop)
    try:
        if spec.holds:  # the holder of the model's weights (launch.resident), not a phase
            from launch.resident import hold

            return hold(spec, rank, prebuilt or {})
        from launch.phase import run_phase

        return run_phase(spec, rank, world, stop, prebuilt)
    except procs.PhaseError as e:
        procs.report_error(Path(spec.phase_dir), rank, e)
        print(f"rank {rank}: {e}", file=sys.stderr)
        return 1
    except BaseException as e:
        procs.report_error(Path(spec.phase_dir), rank, e)
        raise


def launched(argv: list[str]) -> int:
    """``main`` in a process that a launcher started (the fork server records how its ranks end):
    the exit code is left in the phase directory, so the orchestrator knows how every rank ended
    on every node, and that one without a record was killed (or lost with its node)."""
    try:
        rc = main(argv)
    except SystemExit as e:  # the orchestrator went away before the go
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    if "RANK" in os.environ:  # else it failed before it knew its rank
        PhaseDir(PhaseSpec.read(argv[1]).phase_dir).write_exit(int(os.environ["RANK"]), rc, time.time())
    return rc


if __name__ == "__main__":
    rc = launched(sys.argv)
    # Everything is written and fsynced; tearing down torch and DeepSpeed module by module takes
    # seconds that the next phase would wait for, so the process ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
