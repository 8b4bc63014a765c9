"""Launcher command lines for a phase: plain functions of the spec, so tests check them as data.

Every launcher runs ``python -m launch.worker SPEC`` once per rank; what differs is who starts the
ranks and sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import sys

from launch.spec import PhaseSpec

WORKER = ["-m", "launch.worker"]


def launcher_of(spec: PhaseSpec) -> str:
    # "local" is one process without a launcher; more than one on this node needs a launcher.
    if spec.launcher == "local" and spec.nproc * spec.nnodes > 1:
        return "deepspeed"
    return spec.launcher


def command(spec: PhaseSpec, spec_path: str, python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that start every rank of the phase."""
    kind = launcher_of(spec)
    port = str(spec.master_port)
    if kind == "local":
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        return [python, *WORKER, spec_path], env
    if kind == "deepspeed":
        argv = [python, "-m", "deepspeed.launcher.runner", "--master_port", port]
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
            argv += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"$MASTER_ADDR:{port}"]
        return argv + [*WORKER, spec_path], {}
    if kind == "slurm":
        argv = ["srun", f"--nodes={spec.nnodes}", f"--ntasks-per-node={spec.nproc}", "--kill-on-bad-exit=1",
                python, *WORKER, spec_path]
        return argv, {"MASTER_PORT": port}
    raise ValueError(f"unknown launcher {spec.launcher!r}")
