"""Launcher command lines for a phase: plain functions of the spec, so tests check them as data.

Every launcher runs ``python -m launch.worker SPEC`` once per rank; what differs is who starts the
ranks and sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. srun sets only its own
SLURM_* variables; ``rank_env_from_slurm`` turns them into those. torchrun on several nodes is one
agent per node started by srun (``launch.agent``), so it runs inside a SLURM allocation too.

On several nodes the processes meet at ``spec.master_addr``: ``launch.master_addr``, else SLURM's
address of the allocation's first node (NodeAddr, by which the controller itself reaches it; its
name need not resolve anywhere). The steps start on that node (``--relative=0``), so rank 0, or the
agent hosting torchrun's rendezvous, is there.
"""

from __future__ import annotations

import math
import os
import re
import socket
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
        if spec.nnodes > 1 and spec.master_addr:
            argv += ["--master_addr", spec.master_addr]
        argv += ["--num_gpus", str(spec.nproc)]
        return argv + ["--module", "launch.worker", spec_path], {}
    if kind == "torchrun" and spec.nnodes == 1:
        argv = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(spec.nproc), "--nnodes", "1",
                "--master_addr", "127.0.0.1", "--master_port", port]
        return argv + [*WORKER, spec_path], {}
    if kind == "torchrun":
        return [*srun(spec, environ, agents=True), python, "-m", "launch.agent", spec_path], {}
    if kind == "slurm":
        return [*srun(spec, environ), python, *WORKER, spec_path], {"MASTER_PORT": port}
    raise ValueError(f"unknown launcher {spec.launcher!r}")


def srun(spec: PhaseSpec, environ: Mapping[str, str], agents: bool = False) -> list[str]:
    """srun's part of a step on ``spec.nnodes`` nodes: a task per rank, or (``agents``) one per node."""
    per_node = 1 if agents else spec.nproc
    argv = ["srun", f"--nodes={spec.nnodes}", f"--ntasks-per-node={per_node}", f"--ntasks={spec.nnodes * per_node}"]
    if environ.get("SLURM_JOB_ID"):  # inside an allocation: from its first node on (outside, srun refuses it)
        argv.append("--relative=0")
    if agents and environ.get("SLURM_CPUS_ON_NODE"):  # an agent's ranks need the node's CPUs, not one task's
        argv.append(f"--cpus-per-task={environ['SLURM_CPUS_ON_NODE']}")
    return argv + ["--kill-on-bad-exit=1"]


def agent_command(spec: PhaseSpec, spec_path: str, python: str, environ: Mapping[str, str]) -> list[str]:
    """The torchrun agent of the node this srun task runs on. The step's first node hosts the
    rendezvous at ``spec.master_addr``; every agent offers the address it reaches that node from,
    which its ranks' MASTER_ADDR becomes where it holds rank 0 (torchrun's default, the host's
    FQDN, need not resolve on the other nodes)."""
    try:
        first, job, step = environ["SLURM_NODEID"] == "0", environ["SLURM_JOB_ID"], environ["SLURM_STEP_ID"]
        addr = spec.master_addr or first_host(environ["SLURM_STEP_NODELIST"])
    except KeyError as e:
        raise ValueError(f"not an srun task: {e.args[0]} is not set") from None
    seconds = math.ceil(spec.rendezvous_seconds)
    return [python, "-m", "torch.distributed.run", "--nnodes", str(spec.nnodes), "--nproc_per_node", str(spec.nproc),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{addr}:{spec.master_port}", "--rdzv_id", f"{job}.{step}",
            "--rdzv_conf", f"is_host={str(first).lower()},join_timeout={seconds},read_timeout={seconds}",
            "--local_addr", addr if first else address_toward(addr, spec.master_port), "--max_restarts", "0",
            *WORKER, spec_path]


def address_toward(addr: str, port: int) -> str:
    """This node's address on the interface that routes to ``addr`` (a UDP socket's connect sends nothing)."""
    try:
        family, kind, _, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(where)
            return s.getsockname()[0]
    except OSError as e:
        raise ValueError(f"the rendezvous address {addr} is not reachable from this node "
                         f"({e.strerror or e}): launch.master_addr names one that every node resolves") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist (``gpu[07-09,12],cpu1`` -> ``gpu07``), without scontrol."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist)
    if first is None:
        raise ValueError(f"not a Slurm hostlist: {nodelist!r}")
    return re.sub(r"\[([^\]\-,]+)[^\]]*\]", r"\1", first.group(0))


def rank_env_from_slurm(environ: Mapping[str, str], master_addr: str | None = None) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR of one srun task, from the SLURM_* variables.

    Rank 0 runs on the first node of the step: ``master_addr`` is its address (the spec's), else
    that node's name, which resolves where the site's names do. MASTER_PORT is not here:
    ``command`` passes the spec's port through srun.
    """
    try:
        env = {"RANK": environ["SLURM_PROCID"], "LOCAL_RANK": environ["SLURM_LOCALID"],
               "WORLD_SIZE": environ["SLURM_NTASKS"]}
    except KeyError as e:
        raise ValueError(f"not an srun task: {e.args[0]} is not set") from None
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if master_addr:
        env["MASTER_ADDR"] = master_addr
    elif nodes:
        env["MASTER_ADDR"] = first_host(nodes)
    else:
        raise ValueError("not an srun task: neither SLURM_STEP_NODELIST nor a master address is given")
    return env
