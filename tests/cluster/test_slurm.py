"""Two nodes for real: ``examples/slurm/relayer.sbatch`` on the two-node SLURM cluster of
``tests/cluster/slurm.py``, one process a node (both nodes share this machine's CPUs).

Uninterrupted, it trains what one process trains. Stopped mid-phase from outside
(``scancel --signal=TERM``), the job ends 75 with a checkpoint, and resubmitted on one node it
ends bitwise where the uninterrupted two-node run ends (the same world size: a placement of ranks
changes no sum). The time limit's signal to the batch script (``--signal=B:USR1@N``, sent here at
once with ``scancel --batch --signal=USR1``, as slurmctld sends it) requeues the job, which resumes;
a SIGKILL of one node's rank then fails the run naming the node and the rank, and a resubmission
resumes. torchrun on two nodes is one agent a node, started by srun. A rendezvous at a node name
that does not resolve (what srun's node list gives outside an allocation here) fails within
``launch.rendezvous_seconds``, naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shard_tools.manifest import list_checkpoints, read_manifest
from tests.cluster.slurm import Cluster
from tests.conftest import ROOT, schedule_dict, write_schedule
from tests.reference import bitwise_equal, composed, max_abs_diff

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SBATCH = ROOT / "examples" / "slurm" / "relayer.sbatch"
BIN = Path(sys.executable).parent
TOL = 1e-5  # test_equivalence's: another summation order
JOB_SECONDS = 420


def schedule(tmp: Path, model: Path, data: Path, name: str = "s", **launch) -> Path:
    launch = {"launcher": "slurm", "nproc": 1, "nnodes": 2, "grace_seconds": 30, **launch}
    raw = schedule_dict(model, data, launch=launch, run={"output_dir": str(tmp / "run")})
    return write_schedule(tmp / f"{name}.toml", raw)


def submit(slurm: Cluster, sched: Path, nodes: int = 2, per_node: int = 1) -> str:
    """The example's job, its resources fitted to this cluster (no GPUs, a CPU a process)."""
    return slurm.sbatch(f"--nodes={nodes}", f"--ntasks-per-node={per_node}", "--cpus-per-task=1",
                        "--gpus-per-node=0", "--time=30", f"--output={sched.parent}/job-%j.out", str(SBATCH),
                        str(sched), cwd=ROOT, env={"RELAYER_VENV": str(BIN.parent)})


def finished(slurm: Cluster, job: str) -> dict[str, str]:
    return slurm.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_SECONDS)


def output(sched: Path, job: str) -> str:
    return (sched.parent / f"job-{job}.out").read_text(errors="replace")


def last_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(x)["step"] for x in lines if x.strip() and '"loss"' in x), default=0)


def wait_for(cond, what: str, timeout: float = JOB_SECONDS) -> None:
    end = time.time() + timeout
    while not cond():
        if time.time() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]


def pid_record(run: Path, phase: int, name: str) -> dict | None:
    try:
        return json.loads((run / "phases" / f"phase-{phase:04d}" / "pids" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def completed(slurm: Cluster, sched: Path, job: str) -> Path:
    state = finished(slurm, job)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), output(sched, job)
    return sched.parent / "run"


@pytest.fixture(scope="module")
def two_nodes(slurm, tmp_path_factory, tiny_model, tiny_data) -> tuple[Path, str]:
    """The uninterrupted run on two nodes, one process each: its run directory and job output."""
    sched = schedule(tmp_path_factory.mktemp("two-nodes"), tiny_model, tiny_data)
    job = submit(slurm, sched)
    return completed(slurm, sched, job), output(sched, job)


def test_two_nodes_train_what_one_process_trains(two_nodes, tiny_run, tiny_model):
    run, out = two_nodes
    assert {read_manifest(c).world_size for c in list_checkpoints(run)} == {2}
    assert {pid_record(run, 0, f"rank-{r}")["host"] for r in (0, 1)} == {"n1", "n2"}
    # The nodes' names do not resolve here: they met at SLURM's address of n1, and plan said so.
    assert "2 nodes meet at 127.0.0.1, SLURM's address (NodeAddr) of n[1-2]'s first node" in out
    assert "launch.nnodes = 2: every switch starts the next phase cold" in out
    assert max_abs_diff(composed(tiny_model, tiny_run), composed(tiny_model, run)) <= TOL


def test_scancel_term_stops_with_a_checkpoint_and_one_node_resumes_bitwise(slurm, tmp_path, tiny_model, tiny_data,
                                                                             two_nodes):
    sched = schedule(tmp_path, tiny_model, tiny_data)
    run = tmp_path / "run"
    job = submit(slurm, sched)
    wait_for(lambda: last_step(run) >= 11, "phase 1's first step")
    slurm.run("scancel", "--signal=TERM", job)  # to the job's steps: the ranks, not the batch script
    state = finished(slurm, job)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "75:0"), output(sched, job)
    steps = [read_manifest(c).global_step for c in list_checkpoints(run)]
    assert steps[:1] == [10] and 10 < steps[-1] < 20, steps  # mid-phase, written at the stop
    assert "preempted by a signal to its ranks in phase 1" in output(sched, job)
    again = submit(slurm, sched, nodes=1, per_node=2)
    assert bitwise_equal(composed(tiny_model, completed(slurm, sched, again)), composed(tiny_model, two_nodes[0]))
    assert {read_manifest(c).world_size for c in list_checkpoints(run)} == {2}
    assert {pid_record(run, 2, f"rank-{r}")["host"] for r in (0, 1)} == {"n1"}


def test_the_time_limit_requeues_and_a_killed_node_is_named(slurm, tmp_path, tiny_model, tiny_data, two_nodes):
    sched = schedule(tmp_path, tiny_model, tiny_data)
    run = tmp_path / "run"
    job = submit(slurm, sched)
    wait_for(lambda: last_step(run) >= 11, "phase 1's first step")
    slurm.run("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@N sends, now
    wait_for(lambda: slurm.job(job)["Restarts"] == "1", "the script's scontrol requeue")
    slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now")  # SLURM holds a requeued job ~2 min
    assert "requeueing job" in output(sched, job)
    resumed = lambda: [e for e in events(run) if e["event"] == "resumed"]  # noqa: E731
    wait_for(lambda: resumed() and last_step(run) > resumed()[0]["step"], "a step of the requeued job")
    assert 10 < resumed()[0]["step"] < 20  # from the checkpoint written at the signal, mid-phase
    rank1 = pid_record(run, 1, "rank-1")
    assert rank1["host"] == "n2"
    os.kill(rank1["pid"], signal.SIGKILL)
    state = finished(slurm, job)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "1:0"), output(sched, job)
    out = output(sched, job)
    assert f"rank 1 on node n2 (pid {rank1['pid']}) ended without an exit code or an error" in out, out
    failed = [e for e in events(run) if e["event"] == "phase_failed"]
    assert "rank 1 on node n2" in failed[-1]["reason"]
    again = submit(slurm, sched)
    assert bitwise_equal(composed(tiny_model, completed(slurm, sched, again)), composed(tiny_model, two_nodes[0]))


def test_torchrun_on_two_nodes_killed_and_resumed_on_one(slurm, tmp_path, tiny_model, tiny_data, two_nodes):
    sched = schedule(tmp_path, tiny_model, tiny_data, launcher="torchrun")
    run = tmp_path / "run"
    job = submit(slurm, sched)
    wait_for(lambda: last_step(run) >= 11, "phase 1's first step")
    # One agent a node, its rank on its node: torchrun's c10d rendezvous hosted on n1 at 127.0.0.1.
    assert {pid_record(run, 1, f"rank-{r}")["host"] for r in (0, 1)} == {"n1", "n2"}
    assert pid_record(run, 1, "agent-0")["host"] == "n1"
    agent = pid_record(run, 1, "agent-1")
    assert agent["host"] == "n2"
    os.kill(agent["pid"], signal.SIGKILL)
    state = finished(slurm, job)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "1:0"), output(sched, job)
    assert "on node n2 (pid" in output(sched, job) and "ended without an exit code or an error" in output(sched, job)
    again = submit(slurm, sched, nodes=1, per_node=2)
    assert bitwise_equal(composed(tiny_model, completed(slurm, sched, again)), composed(tiny_model, two_nodes[0]))
    assert [e["step"] for e in events(run) if e["event"] == "resumed"] == [10]


def test_a_rendezvous_at_a_name_that_does_not_resolve_fails_in_bounded_time(slurm, tmp_path, tiny_model, tiny_data):
    # Outside an allocation srun makes one for each step, and the ranks meet at its first node's
    # name, n1, as before SLURM's addresses were used: it resolves nowhere here.
    sched = schedule(tmp_path, tiny_model, tiny_data, rendezvous_seconds=10)
    t0 = time.time()
    r = subprocess.run([str(BIN / "orchestrator"), "run", str(sched)], capture_output=True, text=True,
                       env=slurm.env, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "the process group did not start within 10 s (launch.rendezvous_seconds)" in r.stderr
    assert "waited at n1:" in r.stderr and "n1 does not resolve on this node" in r.stderr
    assert time.time() - t0 < 200
