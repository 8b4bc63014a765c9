"""What a switch costs on several nodes: one schedule, two processes in all, four ways, on the
two-node SLURM cluster of tests/cluster/slurm.py (started here, stopped at the end; root).

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/multinode_switch.py --out benchmarks/results/multinode-cpu

- one node, pre-warmed: ``launcher = "local"``, 2 processes (the fork server; the default);
- one node, cold through srun: ``launcher = "slurm"``, 1 node x 2 (sbatch examples/slurm/relayer.sbatch);
- two nodes, cold: ``launcher = "slurm"``, 2 nodes x 1;
- two nodes, torchrun: ``launcher = "torchrun"``, 2 nodes x 1 (an agent a node, through srun).

A switch's overhead is from phase k's last step to phase k+1's first, less a steady step (as
``orchestrator report`` counts it); the wall is the journal's, from run_started to run_done (no
queueing). Every way must end with bitwise the same weights (one world size), which it checks.
The machine's load average before and after each way goes with it: on a shared machine the
cold ways' imports compete with whatever else runs. Writes result.json and result.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from _tiny_schedule import parse_args

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAYS = {  # name: (launcher, nodes, processes per node)
    "one node, pre-warmed (local)": ("local", 1, 2),
    "one node, cold (srun)": ("slurm", 1, 2),
    "two nodes, cold (srun)": ("slurm", 2, 1),
    "two nodes, torchrun agents (srun)": ("torchrun", 2, 1),
}


def one_way(cluster, work: Path, model: Path, data: Path, name: str, phases: int, steps: int) -> dict:
    from tests.conftest import schedule_dict, write_schedule

    launcher, nodes, per_node = WAYS[name]
    load_before = os.getloadavg()[0]
    tag = f"{launcher}-{nodes}x{per_node}"
    sched = write_schedule(work / f"{tag}.toml", schedule_dict(
        model, data, run={"output_dir": str(work / tag)}, launch={"launcher": launcher, "nproc": per_node, "nnodes": nodes},
        schedule={"phases": [{"steps": steps, "layers": [i % 4]} for i in range(phases)]}))
    if launcher == "local":
        r = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(sched)], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr)
    else:
        job = cluster.sbatch(f"--nodes={nodes}", f"--ntasks-per-node={per_node}", "--cpus-per-task=1",
                             "--gpus-per-node=0", "--time=60", f"--output={work}/{tag}.out",
                             str(ROOT / "examples" / "slurm" / "relayer.sbatch"), str(sched), cwd=ROOT,
                             env={"RELAYER_VENV": str(Path(sys.executable).parent.parent)})
        state = cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED"), 3600)
        if state["JobState"] != "COMPLETED":
            raise SystemExit((work / f"{tag}.out").read_text())
    return measured(work / tag) | {"launcher": launcher, "nodes": nodes, "processes_per_node": per_node,
                                   "load_average_1min": [load_before, os.getloadavg()[0]]}


PIECES = {  # a switch's pieces: (from, to), the first of the finished phase, the second of the next
    "the last phase's save and exit": (("a", "t_last_step_end"), ("a", "t_gone")),
    # psutil's process start times run ahead of time.time() here: none of them is used.
    "start, imports, process group": (("a", "t_gone"), ("b", "t_group_ready")),
    "model and data": (("b", "t_group_ready"), ("b", "t_model_ready")),
    "engine and restore": (("b", "t_model_ready"), ("b", "t_restored")),
}


def measured(run: Path) -> dict:
    events = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    done = [e["records"] for e in events if e["event"] == "phase_done"]
    pairs = list(zip(done, done[1:]))
    switches = [b["t_first_step_end"] - a["t_last_step_end"] - b["step_seconds_median"] for a, b in pairs]
    pieces = {name: median([pair[y[0] == "b"][y[1]] - pair[x[0] == "b"][x[1]] for pair in pairs])
              for name, (x, y) in PIECES.items()}
    at = {e["event"]: e["time"] for e in events if e["event"] in ("run_started", "run_done")}
    return {"wall_seconds": at["run_done"] - at["run_started"], "switch_overhead_seconds": switches,
            "median_pieces_seconds": pieces, "run": run}


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    args = parse_args(__doc__)
    from tests.cluster.slurm import Cluster, install
    from tests.conftest import make_llama, make_tokens
    from tests.reference import bitwise_equal, composed

    if reason := install():
        raise SystemExit(reason)
    cluster = Cluster()
    try:
        cluster.start()
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            model, data = make_llama(work / "model"), make_tokens(work / "train.jsonl")
            ways = {name: one_way(cluster, work, model, data, name, args.phases, args.steps) for name in WAYS}
            weights = [composed(model, way.pop("run")) for way in ways.values()]
            equal = all(bitwise_equal(weights[0], w) for w in weights[1:])
        slurm = cluster.run("srun", "--version").stdout.strip()
    finally:
        cluster.stop()
    write(args, ways, equal, slurm)


def commit() -> str:
    """The commit measured; "with uncommitted changes" where its code (not its docs) differs from it."""
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    code = ["launch", "orchestrator", "shard_tools", "benchmarks/*.py", "examples", "tests"]
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *code], capture_output=True,
                           text=True, cwd=ROOT).stdout.strip()
    return r.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def write(args, ways: dict, equal: bool, slurm: str) -> None:
    import torch

    result = {"date": datetime.date.today().isoformat(), "host": platform.node(), "cores": os.cpu_count(),
              "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
              "torch": torch.__version__, "slurm": slurm, "phases": args.phases, "steps_per_phase": args.steps,
              "relayer_commit": commit(), "command": " ".join(["benchmarks/multinode_switch.py", *sys.argv[1:]]),
              "ways": ways, "bitwise_equal": equal}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    rows = "".join(f"| {name} | {w['wall_seconds']:.1f} | {median(w['switch_overhead_seconds']):.2f} | "
                   f"{min(w['switch_overhead_seconds']):.2f}-{max(w['switch_overhead_seconds']):.2f} | "
                   + " | ".join(f"{v:.2f}" for v in w["median_pieces_seconds"].values())
                   + " | {:.1f} -> {:.1f} |\n".format(*w["load_average_1min"]) for name, w in ways.items())
    (args.out / "result.md").write_text(
        f"# A switch on one node and on two, {result['date']}\n\n{result['cores']} cores ({result['cpu']}, host "
        f"{result['host']}), Python {result['python']}, torch {result['torch']}, {slurm}, relayer "
        f"{result['relayer_commit']}. {args.phases} phases of {args.steps} steps, the tiny Llama, 2 processes in "
        "all.\n\n| way | wall (s) | median switch overhead (s) | range (s) | "
        + " | ".join(f"{p} (s)" for p in PIECES) + " | load average (1 min, before -> after) |\n"
        + "|---" * (5 + len(PIECES)) + "|\n"
        f"{rows}\nPre-warmed, the next phase's processes start and prepare while the last one trains: its pieces up "
        "to the engine lie before the switch (its start is negative). Final weights bitwise "
        f"equal across the ways: {equal}. Command: {result['command']}\n")
    print((args.out / "result.md").read_text())


if __name__ == "__main__":
    main()
