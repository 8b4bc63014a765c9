"""Two nodes for real: ``examples/slurm/relayer.sbatch`` on the two-node SLURM cluster of
``tests/cluster/slurm.py``, one process a node (both nodes share this machine's CPUs).

Every srun step starts its phase cold (some 15 s here), so one run goes through it all, each job
resuming where the one before stopped: on two nodes, its phase 0 trains bitwise what two processes
on one node train (a placement of ranks changes no sum), and what one process trains to rounding;
the time limit's signal to the batch script (``--signal=B:USR1@N``, sent here at once with
``scancel --batch --signal=USR1``, as slurmctld sends it) requeues the job, which resumes; a
SIGKILL of one node's rank fails it naming the node and the rank. Resubmitted on one node it
resumes, and ``scancel --signal=TERM`` mid-phase makes it end 75 with a checkpoint. Then torchrun
on two nodes, one agent a node started by srun: a killed agent fails the job naming its node, and
on one node the run resumes and ends bitwise where the uninterrupted run ends. A rendezvous at a
node name that does not resolve (what srun's node list gives outside an allocation here) fails
within ``launch.rendezvous_seconds``, naming it.
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

from shard_tools.store import Checkpoints
from tests.cluster.slurm import Cluster
from tests.conftest import ROOT, cli, faults_env, schedule_dict, write_schedule
from tests.reference import bitwise_equal, composed, max_abs_diff

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SBATCH = ROOT / "examples" / "slurm" / "relayer.sbatch"
BIN = Path(sys.executable).parent
TOL = 1e-5  # test_equivalence's: another summation order
JOB_SECONDS = 420


def schedule(tmp: Path, model: Path, data: Path, **launch) -> Path:
    launch = {"launcher": "slurm", "nproc": 1, "nnodes": 2, "grace_seconds": 30, **launch}
    raw = schedule_dict(model, data, launch=launch, run={"output_dir": str(tmp / "run")})
    return write_schedule(tmp / "schedule.toml", raw)


# Each micro-batch of the jobs waits this long: the tiny model's phase trained its 10 steps in 0.1 s, and
# what a test does at a step (a kill of a phase's rank, a stop early in a phase) came after the phase had
# ended, or, where CI's polls missed every phase's first steps, never (2026-12-06).
SLOW = faults_env(hold_at={"point": "data.micro_batch", "seconds": 0.3})


def submit(slurm: Cluster, sched: Path, nodes: int = 2, per_node: int = 1, slow: bool = True) -> str:
    """The example's job, its resources fitted to this cluster (no GPUs, a CPU a process), its steps
    slowed (``SLOW``) where the test acts during them."""
    return slurm.sbatch(f"--nodes={nodes}", f"--ntasks-per-node={per_node}", "--cpus-per-task=1",
                        "--gpus-per-node=0", "--time=30", f"--output={sched.parent}/job-%j.out", str(SBATCH),
                        str(sched), cwd=ROOT, env={"RELAYER_VENV": str(BIN.parent), **(SLOW if slow else {})})


def finished(slurm: Cluster, job: str) -> tuple[str, str]:
    state = slurm.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_SECONDS)
    return state["JobState"], state["ExitCode"]


def output(sched: Path, job: str) -> str:
    return (sched.parent / f"job-{job}.out").read_text(errors="replace")


def step_since(run: Path, t0: float) -> int:
    """The newest step trained after ``t0`` (0: none yet)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    records = [json.loads(x) for x in lines if x.strip() and '"loss"' in x]
    return max((r["step"] for r in records if r["time"] > t0), default=0)


def wait_for(cond, what: str, timeout: float = JOB_SECONDS) -> None:
    end = time.time() + timeout
    while not cond():
        if time.time() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def events(run: Path, name: str) -> list[dict]:
    return [e for x in (run / "journal.jsonl").read_text().splitlines() if (e := json.loads(x))["event"] == name]


def pid_record(run: Path, phase: int, name: str) -> dict:
    return json.loads((run / "phases" / f"phase-{phase:04d}" / "pids" / f"{name}.json").read_text())


def checkpoint_steps(run: Path) -> list[int]:
    store = Checkpoints(run)
    return [store.manifest(c).global_step for c in store.all()]


def weights_at(model: Path, run: Path, step: int) -> dict:
    return composed(model, run, Checkpoints(run).at(step))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, tiny_model, tiny_data) -> Path:
    """The reference: the same run, uninterrupted, on one node in two processes (no SLURM)."""
    d = tmp_path_factory.mktemp("two-processes")
    sched = write_schedule(d / "schedule.toml", schedule_dict(tiny_model, tiny_data, launch={"nproc": 2},
                                                              run={"output_dir": str(d / "run")}))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    return d / "run"


def requeued_then_killed(slurm: Cluster, sched: Path, run: Path) -> int:
    """Two nodes: the time limit's requeue, then a rank SIGKILLed on n2. The step the requeued job
    resumed from."""
    t0, job = time.time(), submit(slurm, sched)
    wait_for(lambda: step_since(run, t0) >= 11, "phase 1's first step")
    slurm.run("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@N sends, now
    wait_for(lambda: slurm.job(job)["Restarts"] == "1" and slurm.job(job)["JobState"] == "PENDING",
             "the script's scontrol requeue")
    # SLURM holds a requeued job ~2 min; started again within the second its last credential was
    # revoked, slurmd refuses it ("Job credential revoked") and the job fails.
    time.sleep(2)
    t1 = time.time()
    slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now")
    wait_for(lambda: events(run, "resumed") and step_since(run, t1) > 0, "a step of the requeued job")
    out = output(sched, job)
    assert "requeueing job" in out
    # The nodes' names do not resolve here: they met at SLURM's address of n1, and plan said so.
    assert "2 nodes meet at 127.0.0.1, SLURM's address (NodeAddr) of n[1-2]'s first node" in out
    assert "launch.nnodes = 2: every switch starts the next phase cold" in out
    resumed = events(run, "resumed")[0]["step"]
    assert 10 < resumed < 20  # from the checkpoint written at the signal, mid-phase
    rank1 = pid_record(run, 1, "rank-1")
    assert rank1["host"] == "n2"
    os.kill(rank1["pid"], signal.SIGKILL)
    assert finished(slurm, job) == ("FAILED", "1:0"), output(sched, job)
    message = f"rank 1 on node n2 (pid {rank1['pid']}) ended without an exit code or an error"
    assert message in output(sched, job)
    assert "rank 1 on node n2" in events(run, "phase_failed")[-1]["reason"]
    return resumed


def stopped_on_one_node(slurm: Cluster, sched: Path, run: Path, resumed: int) -> tuple[int, int]:
    """Resubmitted on one node, stopped by ``scancel --signal=TERM`` early in a phase: the step of its
    checkpoint and the phase. Not in a phase's last steps: resumed at step 18 of phase 1's 20, a stop
    after the first step landed in phase 2 (CI, 2026-12-06)."""
    t0, job = time.time(), submit(slurm, sched, nodes=1, per_node=2)
    seen = []

    def early_in_a_phase() -> bool:
        seen.append(step_since(run, t0))
        return 0 < seen[-1] % 10 <= 6

    wait_for(early_in_a_phase, "a step of the job on one node early in a phase")
    phase = (seen[-1] - 1) // 10
    slurm.run("scancel", "--signal=TERM", job)  # to the job's steps: the ranks, not the batch script
    assert finished(slurm, job) == ("FAILED", "75:0"), output(sched, job)
    assert f"preempted by a signal to its ranks in phase {phase}" in output(sched, job)
    assert {pid_record(run, phase, f"rank-{r}")["host"] for r in (0, 1)} == {"n1"}
    stopped = checkpoint_steps(run)[-1]
    assert resumed < stopped and 10 * phase < stopped < 10 * (phase + 1)  # mid-phase, written at the stop
    return stopped, phase


def torchrun_agent_killed(slurm: Cluster, sched: Path, run: Path, phase: int) -> None:
    """torchrun on two nodes: an agent a node, its ranks on its node; n2's agent SIGKILLed."""
    t0, job = time.time(), submit(slurm, sched)
    wait_for(lambda: step_since(run, t0) > 0, "a step of the torchrun job")
    assert {pid_record(run, phase, f"rank-{r}")["host"] for r in (0, 1)} == {"n1", "n2"}
    assert pid_record(run, phase, "agent-0")["host"] == "n1"  # the c10d rendezvous' host, at 127.0.0.1
    agent = pid_record(run, phase, "agent-1")
    assert agent["host"] == "n2"
    os.kill(agent["pid"], signal.SIGKILL)
    assert finished(slurm, job) == ("FAILED", "1:0"), output(sched, job)
    out = output(sched, job)
    assert "on node n2 (pid" in out and "ended without an exit code or an error" in out, out


def test_one_run_requeued_stopped_killed_and_resumed_across_nodes(slurm, tmp_path, tiny_model, tiny_data, tiny_run,
                                                                  two_processes):
    sched = schedule(tmp_path, tiny_model, tiny_data)
    run = tmp_path / "run"
    resumed = requeued_then_killed(slurm, sched, run)
    stopped, phase = stopped_on_one_node(slurm, sched, run, resumed)
    sched = schedule(tmp_path, tiny_model, tiny_data, launcher="torchrun")  # launch.* may change on a resume
    torchrun_agent_killed(slurm, sched, run, phase)
    job = submit(slurm, sched, nodes=1, per_node=2, slow=False)  # to its end: nothing to act on
    assert finished(slurm, job) == ("COMPLETED", "0:0"), output(sched, job)
    assert [e["step"] for e in events(run, "resumed")] == [resumed, resumed, stopped, stopped]
    store = Checkpoints(run)
    assert {store.manifest(c).world_size for c in store.all()} == {2}
    assert bitwise_equal(composed(tiny_model, run), composed(tiny_model, two_processes))
    assert max_abs_diff(composed(tiny_model, run), composed(tiny_model, tiny_run)) <= TOL
    # Phase 0, uninterrupted on two nodes, trained what two processes on one node train.
    assert {pid_record(run, 0, f"rank-{r}")["host"] for r in (0, 1)} == {"n1", "n2"}
    assert bitwise_equal(weights_at(tiny_model, run, 10), weights_at(tiny_model, two_processes, 10))


def test_a_rendezvous_at_a_name_that_does_not_resolve_fails_in_bounded_time(slurm, tmp_path, tiny_model, tiny_data):
    # Outside an allocation srun makes one for each step, and the ranks meet at its first node's
    # name, n1, as before SLURM's addresses were used: it resolves nowhere here.
    sched = schedule(tmp_path, tiny_model, tiny_data, rendezvous_seconds=5)
    t0 = time.time()
    r = subprocess.run([str(BIN / "orchestrator"), "run", str(sched)], capture_output=True, text=True,
                       env=slurm.env, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "the process group did not start within 5 s (launch.rendezvous_seconds)" in r.stderr
    assert "waited at n1:" in r.stderr and "n1 does not resolve on this node" in r.stderr
    assert time.time() - t0 < 200
