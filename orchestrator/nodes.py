"""Several nodes, seen from the control plane: where a phase's processes meet, what a switch costs
there, and how its ranks ended on the nodes they ran on.

The rendezvous address is ``launch.master_addr``, else SLURM's address of the allocation's first
node (NodeAddr in ``scontrol show node``: what the controller reaches it by; the node's *name*
need not resolve on any node). It is looked up once, put in every phase's spec, and checked by
``plan`` and ``run`` where they can (inside the allocation, or a given address): it must resolve.

Pre-warming and the device handover work through FIFOs and device memory of one machine, so on
several nodes (and for every srun step) a switch starts the next phase cold on every node.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from launch.contract.files import RANK, PhaseDir, PidRecord, rank_name

from orchestrator.errors import Preempted, ScheduleError
from orchestrator.schedule import LaunchSection
from shard_tools.files import SMALL_FILE, read_regular

SRUN_LAUNCHERS = ("slurm", "torchrun")
"""The launchers whose processes srun starts on several nodes (torchrun: one agent a node)."""


def check_hostfile(path: Path, launch: LaunchSection, source: Path) -> None:
    """A DeepSpeed hostfile ("host slots=N" lines; # comments) that can serve launch.nnodes nodes of
    launch.nproc processes: DeepSpeed would otherwise start fewer, and the rendezvous wait for the rest."""
    try:
        text = read_regular(path, SMALL_FILE).decode("utf-8", errors="replace")
    except OSError as e:
        raise ScheduleError(f"{source}: launch.hostfile: cannot read {path}: {e.strerror or e}") from None
    hosts: dict[str, int | None] = {}
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            slots = next((w.partition("=")[2] for w in words[1:] if w.startswith("slots=")), "")
            hosts[words[0]] = int(slots) if slots.isdigit() else None
    if len(hosts) < launch.nnodes:
        raise ScheduleError(f"{source}: launch.hostfile: {path} names {len(hosts)} host(s), launch.nnodes = "
                            f"{launch.nnodes} needs that many")
    short = [h for h in list(hosts)[:launch.nnodes] if (hosts[h] or launch.nproc) < launch.nproc]
    if short:
        raise ScheduleError(f"{source}: launch.hostfile: {path}: {short[0]} has slots={hosts[short[0]]}, fewer than "
                            f"launch.nproc = {launch.nproc} processes a node")


def master_addr(launch: LaunchSection, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where a phase's processes meet: on one node the loopback (srun may start them on any node);
    on several, ``launch.master_addr``, else (under srun, inside an allocation) SLURM's address of
    its first node; None where neither applies."""
    if launch.nnodes == 1:
        return "127.0.0.1"
    if launch.master_addr:
        return launch.master_addr
    nodes = environ.get("SLURM_JOB_NODELIST")
    if launch.launcher not in SRUN_LAUNCHERS or not nodes:
        return None
    return node_address(nodes)


@functools.lru_cache(maxsize=8)
def node_address(nodelist: str) -> str:
    """SLURM's address (NodeAddr) of the first node of a hostlist such as ``gpu[07-09]``."""
    first = _scontrol("show", "hostnames", nodelist).split()[0]
    fields = dict(f.split("=", 1) for f in _scontrol("show", "node", "-o", first).split() if "=" in f)
    if not fields.get("NodeAddr"):
        raise ScheduleError(f"launch.master_addr: scontrol show node {first} names no NodeAddr: set launch.master_addr")
    return fields["NodeAddr"]


def _scontrol(*args: str) -> str:
    try:
        r = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ScheduleError(f"launch.master_addr: scontrol {' '.join(args)}: {e}: set launch.master_addr") from None
    if r.returncode != 0 or not r.stdout.strip():
        why = r.stderr.strip() or f"exit code {r.returncode}, no output"
        raise ScheduleError(f"launch.master_addr: scontrol {' '.join(args)} failed ({why}): set launch.master_addr")
    return r.stdout


def check_launch(launch: LaunchSection, source: Path, environ: Mapping[str, str] = os.environ) -> None:
    """What plan and run can check of a launch on several nodes from here: srun is there for the
    launchers that need it, and the rendezvous address resolves (at least on this node)."""
    srun_needed = launch.launcher == "slurm" or (launch.launcher == "torchrun" and launch.nnodes > 1)
    if srun_needed and shutil.which("srun") is None:
        how, instead = ("starts each phase", "") if launch.launcher == "slurm" else (
            f"on {launch.nnodes} nodes starts an agent on each node", ': outside SLURM, use "deepspeed" with a hostfile')
        raise ScheduleError(f'{source}: launch.launcher: "{launch.launcher}" {how} with srun, which is not on PATH'
                            + instead)
    try:
        addr = master_addr(launch, environ)
    except ScheduleError as e:
        raise ScheduleError(f"{source}: {e}") from None
    if addr is None:
        return
    try:
        socket.getaddrinfo(addr, None)
    except (socket.gaierror, UnicodeError) as e:
        given = "launch.master_addr" if launch.master_addr else "SLURM's NodeAddr of the allocation's first node"
        raise ScheduleError(f"{source}: launch.master_addr: the rendezvous address {addr!r} ({given}) does not "
                            f"resolve on this node ({getattr(e, 'strerror', None) or e}): name one that every "
                            "node resolves") from None


def cold_switch(launch: LaunchSection) -> str | None:
    """Why every switch starts the next phase cold, where the launch rules pre-warming out; None elsewhere."""
    if launch.nnodes > 1:
        where = f"launch.nnodes = {launch.nnodes}"
    elif launch.launcher == "slurm":
        where = 'launch.launcher = "slurm"'
    else:
        return None
    return (f"{where}: every switch starts the next phase cold once the last one's processes are gone (imports, "
            "model load, engine build; docs/multi-node.md): pre-warming and the handover work on one node only")


def plan_lines(launch: LaunchSection, environ: Mapping[str, str] = os.environ) -> list[str]:
    """What ``plan`` says of a launch on several nodes: where the processes meet."""
    if launch.nnodes == 1:
        return []
    if launch.master_addr:
        return [f"{launch.nnodes} nodes meet at launch.master_addr = {launch.master_addr}"]
    if launch.launcher in SRUN_LAUNCHERS and environ.get("SLURM_JOB_NODELIST"):
        return [f"{launch.nnodes} nodes meet at {master_addr(launch, environ)}, SLURM's address (NodeAddr) of "
                f"{environ['SLURM_JOB_NODELIST']}'s first node"]
    if launch.launcher in SRUN_LAUNCHERS:
        return [f"{launch.nnodes} nodes meet at SLURM's address (NodeAddr) of the allocation's first node, "
                "looked up inside the allocation (or set launch.master_addr)"]
    return [f"{launch.nnodes} nodes meet where the hostfile's first host is (or set launch.master_addr)"]


def _pid_record(files: PhaseDir, rank: int) -> PidRecord | None:
    try:
        return PidRecord.model_validate_json((files.pids / f"{rank_name(rank)}.json").read_bytes())
    except (OSError, ValidationError):
        return None


def silent_ranks(phase_dir: Path, world: int) -> list[str]:
    """The ranks of a launcher's group that started but left neither an exit code nor an error:
    killed (SIGKILL, the OOM killer), or lost with their node. Named with their node."""
    files = PhaseDir(phase_dir)
    errors = {p.stem for p in files.errors.glob(f"{RANK}*.txt")}
    out = []
    for rank in range(world):
        rec = _pid_record(files, rank)
        if rec is None or files.read_exit(rank) is not None or rank_name(rank) in errors:
            continue
        node = f" on node {rec.host}" if rec.host else ""
        out.append(f"rank {rank}{node} (pid {rec.pid}) ended without an exit code or an error: killed by a "
                   "signal, or lost with its node")
    return out


def stopped_outside(phase_dir: Path, world: int) -> bool:
    """Every rank of the group stopped at a signal of its own and wrote its checkpoint (exit code
    75, as the orchestrator's): ``scancel --signal=TERM``, a preemption that signals the ranks."""
    files = PhaseDir(phase_dir)
    exits = [files.read_exit(rank) for rank in range(world)]
    return all(e is not None and e.rc == Preempted.exit_code for e in exits)
