"""Issue #24's 7B stall, reproduced small: a LISA run whose run directory's file system fills while
a handed-over predecessor writes its end checkpoint, watched from outside.

    OUT=/tmp/o python benchmarks/stall_repro.py --shape 1.1b --fill filler     # the lent H200 (run_stall_repro.sh)
    OUT=/tmp/o DS_ACCELERATOR=cpu python benchmarks/stall_repro.py --shape tiny --fill none --stall-write

Why a 1.1B model reproduces the 7B case: what stalled there is the path, not the size. Phase k
offers its state to its pre-warmed successor (CUDA IPC), the successor trains from it, and phase
k, alive, writes its end checkpoint; the disk filled during that write. Here the run directory's
file system is left with room for the first ``--room-checkpoints`` end checkpoints only (one 1.1B
end checkpoint is measured as the run goes: head fp32 + Adam, two layers), so the same write, of a
later phase, meets ENOSPC the same way, minutes sooner. ``--fill filler`` leaves that room on the
disk the run is on (fallocate, as the 7B machine's disk was full of the earlier run's files);
``tmpfs`` mounts a tmpfs of that size instead (needs root); ``none`` fills nothing (with
``--stall-write`` a rank stalls in that write through the fault points, for trying this on a CPU).

What comes back in $OUT: log.txt (everything printed), and per look (``--looks``: seconds of no
progress at which to look) looks/T/: for every process of the run its state, wchan,
/proc/PID/stack (root) and ``py-spy dump --native`` (py-spy from the wheels); then the run's
journal, metrics, every phase's worker.log, stages, records, stacks/ (the watchdog's), df. After
the last look the orchestrator gets SIGTERM; how long it took to end (or that it did not within
grace + 30 s, then SIGKILL of all) is in result.json with its exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import SHAPES  # noqa: E402
from switch import write_schedule, write_tokens  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1.1b", choices=sorted(SHAPES))
    ap.add_argument("--fill", default="filler", choices=("filler", "tmpfs", "none"))
    ap.add_argument("--room-checkpoints", type=float, default=1.5,
                    help="room left for this many end checkpoints (beyond the model-free run files)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/stall-repro"))
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--looks", default="20,60", help="seconds of no progress at which to look")
    ap.add_argument("--stall-seconds", type=float, default=20.0,
                    help="launch.stall_seconds of the run (a handed-over write gets 4 times it)")
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--stall-write", action="store_true", help="a rank stalls in its checkpoint write (fault point)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds for all of it")
    return ap.parse_args()


def say(*what: object) -> None:
    print(f"[stall_repro {time.strftime('%H:%M:%S')}]", *what, flush=True)


def make_inputs(args: argparse.Namespace, shape: dict, cuda: bool) -> dict:
    """The model (made once, outside the run's file system), the tokens, the setup."""
    model_dir = args.work / f"model-{args.shape}"
    setup = {"model_dir": str(model_dir), "model_config": shape["model"], "seed": 0,
             "dtype": "bfloat16" if cuda else "float32", "data_path": str(args.work / "train.jsonl"),
             "seq_len": shape["seq_len"], "batch_size": shape["batch_size"], "micro_batch_size": shape["micro_batch_size"],
             "lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 1.0,
             "zero_stage": 2, "nproc": 1, "handover": "auto" if cuda else "on", "prewarm_depth": 3,
             "phases": [{"steps": args.steps, "layers": [2 * i % shape["model"]["num_hidden_layers"],
                                                         (2 * i + 1) % shape["model"]["num_hidden_layers"]]}
                        for i in range(args.phases)]}
    if not (model_dir / "config.json").exists():
        say("making the model", model_dir)
        # In a process of its own: this one must hold no device memory while the run goes.
        subprocess.run([sys.executable, "-c", "import json, sys; from _baselines import make_model; "
                        "make_model(json.loads(sys.argv[1]))", json.dumps(setup)], cwd=Path(__file__).parent, check=True)
    write_tokens(Path(setup["data_path"]), args.phases * args.steps * shape["batch_size"] + 64, shape["seq_len"],
                 shape["model"]["vocab_size"], 0)
    return setup


def checkpoint_bytes(shape: dict) -> int:
    """One end checkpoint: the head (embeddings, lm_head, norm) in fp32 with Adam's two moments,
    two layers in the model's dtype (bf16), plus the state file."""
    m = shape["model"]
    h, v, i = m["hidden_size"], m["vocab_size"], m["intermediate_size"]
    kv = h * m["num_key_value_heads"] // m["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 12 * (2 * v * h + h) + 2 * 2 * layer + (1 << 20)


def fill(args: argparse.Namespace, run_root: Path, room: int) -> None:
    run_root.mkdir(parents=True, exist_ok=True)
    if args.fill == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room},mode=0700", "tmpfs", str(run_root)], check=True)
    elif args.fill == "filler":
        free = shutil.disk_usage(run_root).free
        subprocess.run(["fallocate", "-l", str(max(0, free - room)), str(args.work / "filler")], check=True)
    say(f"{args.fill}: {shutil.disk_usage(run_root).free / 1e9:.2f} GB free for the run "
        f"(one end checkpoint ~{checkpoint_bytes(SHAPES[args.shape]) / 1e9:.2f} GB)")


def run_processes(orch: psutil.Process) -> list[psutil.Process]:
    try:
        return [orch, *orch.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def look(at: Path, orch: psutil.Process, run: Path) -> None:
    """Every process's kernel and Python side, and the run's records, into ``at``."""
    at.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy")
    for p in run_processes(orch):
        lines = [f"pid {p.pid}: {' '.join(_safe(p.cmdline))[:300]}"]
        for task in sorted(Path(f"/proc/{p.pid}/task").glob("*")):
            lines.append(f"  task {task.name}: state {_file(task / 'stat').rsplit(')', 1)[-1].split()[:1]} "
                         f"wchan {_file(task / 'wchan')} syscall {_file(task / 'syscall').split()[:1]}")
            lines += [f"    {x}" for x in _file(task / "stack").splitlines()]
        if spy:
            r = subprocess.run([spy, "dump", "--native", "--pid", str(p.pid)], capture_output=True, text=True, timeout=60)
            lines += ["  py-spy:", *(f"    {x}" for x in (r.stdout + r.stderr).splitlines())]
        (at / f"{p.pid}.txt").write_text("\n".join(lines) + "\n")
    collect(run, at)


def _safe(f):
    try:
        return f()
    except psutil.Error:
        return ["?"]


def _file(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError as e:
        return f"({e.strerror})"


def collect(run: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in [run / "journal.jsonl", run / "metrics.jsonl", *run.glob("phases/*/*.log"), *run.glob("phases/*/*.jsonl"),
              *run.glob("phases/*/records.json"), *run.glob("phases/*/stacks/*"), *run.glob("phases/*/errors/*")]:
        if f.is_file() and f.stat().st_size < 8 << 20:
            dest = out / f.relative_to(run)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    (out / "df.txt").write_text(subprocess.run(["df", "-h", str(run.parent)], capture_output=True, text=True).stdout)


def progress(run: Path) -> int:
    """Bytes the run has logged and written outside its checkpoints: grows while it moves."""
    return sum(f.stat().st_size for f in [run / "metrics.jsonl", run / "journal.jsonl", *run.glob("phases/*/stages.jsonl")]
               if f.exists())


def watch(args: argparse.Namespace, orch: subprocess.Popen, run: Path, out: Path, t0: float) -> dict:
    """Looks at each of ``--looks`` seconds of no progress; gives the watchdog its time (4 times
    ``--stall-seconds``, and its dump and grace); then SIGTERM, and how long it took."""
    looks = sorted(float(x) for x in args.looks.split(","))
    watchdog = 4 * args.stall_seconds + 30 + args.grace
    proc, seen, still_since = psutil.Process(orch.pid), -1, time.time()
    while orch.poll() is None and (looks or time.time() - still_since < watchdog) \
            and time.time() - t0 < args.timeout - args.grace - 60:
        now = progress(run)
        if now != seen or not (run / "metrics.jsonl").exists():  # silence counts from the first step on
            seen, still_since = now, time.time()
        elif looks and time.time() - still_since >= looks[0]:
            say(f"no progress for {looks[0]:g} s: looking")
            look(out / "looks" / f"{looks.pop(0):g}s", proc, run)
        time.sleep(1)
    result = {"ended_by_itself": orch.poll() is not None, "rc": orch.poll()}
    if orch.poll() is None:
        say("SIGTERM to the orchestrator")
        t_stop = time.time()
        orch.send_signal(signal.SIGTERM)
        try:
            orch.wait(args.grace + 30)
        except subprocess.TimeoutExpired:
            say("still there after grace + 30 s: looking, then SIGKILL of all")
            look(out / "looks" / "after-sigterm", proc, run)
            for p in run_processes(proc):
                p.kill()
            orch.wait(30)
        result.update(rc=orch.returncode, stop_seconds=round(time.time() - t_stop, 1))
    return result


def main() -> int:
    args = parse()
    out = Path(os.environ["OUT"])
    cuda = os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    shape = SHAPES[args.shape]
    args.work.mkdir(parents=True, exist_ok=True)
    setup = make_inputs(args, shape, cuda)
    run_root = args.work / "fs"
    fill(args, run_root, 256 << 20 if args.fill == "none" else int(args.room_checkpoints * checkpoint_bytes(shape)) + (256 << 20))
    sched = run_root / "schedule.toml"
    write_schedule(sched, setup)
    keys = {"launch.stall_seconds": args.stall_seconds, "launch.grace_seconds": args.grace,
            "checkpoint.keep_last": 100}  # every checkpoint kept: the disk fills as the 7B run's did
    env = {**os.environ}
    if args.stall_write:
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "faults"), env.get("PYTHONPATH", "")]),
                   RELAYER_TEST_FAULTS=json.dumps({"stall_at": {"point": "checkpoint.file_written"}}))
    t0 = time.time()
    with open(out / "orchestrator.log", "w") as log:
        sets = [x for k, v in keys.items() for x in ("--set", f"{k}={v}")]
        orch = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(sched), *sets], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        result = watch(args, orch, run_root / "run", out, t0)
    collect(run_root / "run", out / "final")
    result["seconds"] = round(time.time() - t0, 1)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    say("result", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
