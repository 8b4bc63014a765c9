"""Launcher command lines for a phase: plain functions of the spec, so tests check them as data.

Every launcher runs ``python -m launch.worker SPEC`` once per rank; what differs is who starts the
ranks and sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. srun sets only its own
SLURM_* variables; ``rank_env_from_slurm`` turns them into those.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

from launch.contract.spec import PhaseSpec

WORKER = ["-m", "launch.worker"]


def launcher_of(spec: PhaseSpec) -> str:
    # "local" is one process without a launcher; more than one on this node needs a launcher.
    if spec.launcher == "local" and spec.nproc * spec.nnodes > 1:
        return "deepspeed"
    return spec.launcher


def command(spec: PhaseSpec, spec_path: str, python: str = sys.executable,
            environ: Mapping[str, str] = os.environ) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that start every rank of the phase; ``environ`` is the launching one."""
    kind = launcher_of(spec)
    port = str(spec.master_port)
    if kind == "local":
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        return [python, *WORKER, spec_path], env
    if kind == "deepspeed":
        # Without --no_local_rank the launcher puts --local_rank=N before the spec path.
        argv = [python, "-m", "deepspeed.launcher.runner", "--master_port", port, "--no_local_rank"]
        if spec.hostfile:
            argv += ["--hostfile", spec.hostfile, "--num_nodes", str(spec.nnodes)]
        argv += ["--num_gpus", str(spec.nproc)]
        return argv + ["--module", "launch.worker", spec_path], {}
    if kind == "torchrun":
        argv = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(spec.nproc),
                "--nnodes", str(spec.nnodes)]
        if spec.nnodes == 1:
            argv += ["--master_addr", "127.0.0.1", "--master_port", port]
        else:
            addr = environ.get("MASTER_ADDR")
            if not addr:
                raise ValueError(f"torchrun on {spec.nnodes} nodes needs MASTER_ADDR in the environment: "
                                 "the address of the node that hosts the rendezvous")
            argv += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{addr}:{port}"]
        return argv + [*WORKER, spec_path], {}
    if kind == "slurm":
        argv = ["srun", f"--nodes={spec.nnodes}", f"--ntasks-per-node={spec.nproc}",
                f"--ntasks={spec.nnodes * spec.nproc}", "--kill-on-bad-exit=1", python, *WORKER, spec_path]
        return argv, {"MASTER_PORT": port}
    raise ValueError(f"unknown launcher {spec.launcher!r}")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist (``gpu[07-09,12],cpu1`` -> ``gpu07``), without scontrol."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist)
    if first is None:
        raise ValueError(f"not a Slurm hostlist: {nodelist!r}")
    return re.sub(r"\[([^\]\-,]+)[^\]]*\]", r"\1", first.group(0))


def rank_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR of one srun task, from the SLURM_* variables.

    Rank 0 runs on the first node of the step, so that node is the rendezvous unless MASTER_ADDR is
    already set. MASTER_PORT is not here: ``command`` passes the spec's port through srun.
    """
    try:
        env = {"RANK": environ["SLURM_PROCID"], "LOCAL_RANK": environ["SLURM_LOCALID"],
               "WORLD_SIZE": environ["SLURM_NTASKS"]}
    except KeyError as e:
        raise ValueError(f"not an srun task: {e.args[0]} is not set") from None
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if environ.get("MASTER_ADDR"):
        env["MASTER_ADDR"] = environ["MASTER_ADDR"]
    elif nodes:
        env["MASTER_ADDR"] = first_host(nodes)
    else:
        raise ValueError("not an srun task: neither SLURM_STEP_NODELIST nor MASTER_ADDR is set")
    return env
