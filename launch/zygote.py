"""The fork server: one process per run that has paid for the imports and the base model, and
forks every phase's ranks from there, so a phase process starts in milliseconds, not seconds.

    python -m launch.zygote SPEC.json REQUESTS_FIFO      # started by the orchestrator
    python -m launch.zygote --early                      # started before the run has a spec: the
                                                         # imports first, then the start on stdin

Each phase is still a fresh process (its device memory dies with it); what the fork inherits is
host-side only: imported modules and the base weights, copy-on-write. CUDA is never initialised
here, and torch runs single-threaded until the fork (a used OpenMP pool does not survive a fork).
Requests are fixed-size JSON records {"spec": path, "nproc": n} on a FIFO that the orchestrator
holds open; EOF means the orchestrator is gone, and so is this process. For each child that exits,
its phase directory gets its exit code (``PhaseDir.write_exit``).
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import threading
import time
import traceback

import psutil

from launch import procs
from launch.contract.channels import EARLY, FORK_REQUESTS, FORK_SERVER_START
from launch.contract.files import DUMP_STACKS, UNRECORDED, PhaseDir, RunDir, rank_name, write_reason
from launch.contract.pids import started
from launch.contract.spec import PhaseSpec
from shard_tools.files import open_append

# Modules a phase's first optimizer and first deepspeed.initialize import; importing them here (no
# device is touched by importing) saves every forked phase that part of its warm-up. The biggest:
# torch.optim's first optimizer imports torch._dynamo, and DeepSpeed's optimizer check imports its
# Muon module, which compiles with it (sympy, networkx, ...): 3.1 s of the first initialize on
# this CPU, 0.03 s once imported (``records.json``'s ``warm_up_imports`` lists what a warm-up still
# imports). Optional: one a DeepSpeed version lacks is skipped.
WARM_IMPORTS = (
    "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3", "deepspeed.runtime.bf16_optimizer",
    "deepspeed.runtime.python_gc", "deepspeed.ops.adam", "deepspeed.utils.bwc", "deepspeed.runtime.state_dict_factory",
    "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_layer",
    "deepspeed.utils.pin_memory", "torch.profiler._cupti_monitor", "deepspeed.compile.backend",
)


def import_all() -> int:
    """What every phase imports (torch, deepspeed, transformers, ``WARM_IMPORTS``, the comm op): paid
    once, here; torch's thread count before it runs single-threaded until the fork."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from launch import phase  # noqa: F401 - the heavy imports: torch, deepspeed, transformers

    for name in WARM_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    from launch.ops import load_comm_ops

    load_comm_ops()  # cached in every forked phase: none of them takes the build lock
    return threads


class Zygote:
    def __init__(self, spec: PhaseSpec, threads: int | None = None):
        self.threads = import_all() if threads is None else threads
        from launch.basemodel import model_key, model_spec
        from shard_tools.model import build_base_model

        base = model_spec(spec)
        self.model = build_base_model(base)
        # Everything here lives as long as the run: no collection in a forked phase scans it (nor
        # writes its pages, shared copy-on-write).
        gc.collect()
        gc.freeze()
        self.key = model_key(base)
        self.children: dict[int, tuple[PhaseDir, int]] = {}
        self.lock = threading.Lock()

    def reap_forever(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.01)
                continue
            with self.lock:
                phase_dir, rank = self.children.pop(pid, (None, None))
            if phase_dir is not None:
                self._record_exit(phase_dir, rank, os.waitstatus_to_exitcode(status))

    @staticmethod
    def _record_exit(phase_dir: PhaseDir, rank: int, rc: int) -> None:
        try:
            phase_dir.write_exit(rank, rc, time.time())
        except OSError as e:
            # Seen on the H200 with a full disk: this thread died here, no later end was recorded,
            # and the orchestrator waited for phases long gone (zombies). Ending is seen at once.
            try:
                print(f"relayer: could not record the end of rank {rank} (exit code {rc}) in {phase_dir.exits}: {e}",
                      file=sys.stderr, flush=True)
            except OSError:
                pass  # the log is on that disk too
            os._exit(UNRECORDED)

    def fork_phase(self, spec_path: str, nproc: int, requests_fd: int) -> None:
        spec = PhaseSpec.read(spec_path)
        phase_dir = PhaseDir(spec.phase_dir)
        for rank in range(nproc):
            with self.lock:
                pid = procs.fork_dying_with_parent()  # so that a rank paused as soon as recorded dies with the run
                if pid == 0:
                    self._child(spec, spec_path, rank, nproc, requests_fd)
                self.children[pid] = (phase_dir, rank)
            try:
                phase_dir.record_pid(rank_name(rank), pid, started(pid))
            except psutil.NoSuchProcess:
                pass  # already gone: its exit file says how

    def _child(self, spec: PhaseSpec, spec_path: str, rank: int, nproc: int, requests_fd: int) -> None:
        rc = 1
        try:
            os.close(requests_fd)
            log = open_append(PhaseDir(spec.phase_dir).log)  # never through a link
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.master_port))
            import torch

            from launch import worker

            torch.set_num_threads(max(1, self.threads // nproc))
            rc = worker.main([sys.argv[0], spec_path], prebuilt={self.key: self.model})
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)


def main(argv: list[str]) -> None:
    threads = None
    if argv[1:] == [EARLY]:
        # Started while the orchestrator still checks the schedule and prepares the data: the
        # imports meanwhile (seconds), then the start; its output goes nowhere until the log is named.
        procs.set_parent_death_signal()
        threads = import_all()
        start = FORK_SERVER_START.read(sys.stdin.fileno())
        if start is None:  # the run needs no fork server after all (or its orchestrator is gone)
            return
        log = open_append(start["log"])  # never through a link
        os.dup2(log, 1)
        os.dup2(log, 2)
        argv = [argv[0], start["spec"], start["fifo"]]
    spec = PhaseSpec.read(argv[1])
    try:
        serve(spec, argv[2], threads)
    except Exception as e:
        # The orchestrator names this reason (and zygote.log's last lines) in the phase's failure.
        write_reason(RunDir(spec.run_dir).zygote_error, e)
        raise


def serve(spec: PhaseSpec, requests: str, threads: int | None = None) -> None:
    procs.set_parent_death_signal()
    if spec.orchestrator_pid is not None:
        procs.watch_orchestrator(spec.orchestrator_pid)
    # Its ranks are recorded as soon as forked: a stack dump asked for before one registered for it
    # (launch.procs.guard_process) must not end it, as the signal's default would.
    signal.signal(DUMP_STACKS, signal.SIG_IGN)
    zygote = Zygote(spec, threads)
    threading.Thread(target=zygote.reap_forever, daemon=True, name="reaper").start()
    fd = os.open(requests, os.O_RDONLY)
    while (request := FORK_REQUESTS.read(fd)) is not None:  # None: the orchestrator is gone
        zygote.fork_phase(request["spec"], request["nproc"], fd)


if __name__ == "__main__":
    main(sys.argv)
