"""What a layer switch costs: relayer against the two ways people switch today, side by side.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/switch.py --shape tiny     # ~85 s of CPU time
    python benchmarks/switch.py --shape 1.1b --phases 8 --steps 20             # CUDA
    python benchmarks/switch.py --shape 7b --ways a,b --model-dir /tmp/m7b     # the model made once, reused
    python benchmarks/switch.py --shape 1.1b --ways a --nproc 2 --handover off # relayer on 2 GPUs, today's path
    python benchmarks/switch.py --shape tiny --ways a,c --results-dir /tmp     # a subset, into a folder

One model shape, one schedule, three ways. Phase k trains the head and the two body layers
(2k mod L, 2k+1 mod L): issue #18's "2 layers a phase" as a fixed walk rather than a seeded LISA
sample, so that every way and every run trains the same layers and the sums of a walk are easy
to read. ``--layers lisa`` samples them as LISA does (seeded by ``--seed``): a layer then comes
back within a few phases, which the walk never does, and a pre-warmed phase meets layers trained
since its preload (``launch.preload``'s ``LayerRefresh``).

  a  relayer    ``orchestrator run`` on a generated schedule: a fresh process group per phase,
                ``--nproc`` processes (``launch.nproc``), ``--handover`` (``launch.handover``)
  b  inprocess  one process; per phase a fresh engine on the same model, then engine.destroy(),
                gc.collect(), torch.cuda.empty_cache() (DeepSpeed issue #6729)
  c  naive      a fresh process per phase that loads the whole model with from_pretrained and
                writes it all back with save_pretrained

b and c run one process and ZeRO-1/2 only: with ``--nproc`` > 1 or ``--zero-stage 3`` they are
left out (results.json's ``notes`` says so). All ways start from the same generated HF model dir
(random init, bf16 on CUDA; ``--model-dir`` reuses one), read the same seeded random token rows in
the same order, and use the same per-process batch (the global batch is it times ``--nproc``),
ZeRO stage, dtype (bf16 on CUDA, fp32 on the CPU), client torch AdamW and bucket sizes. Per
switch k -> k+1 the overhead is (end of the first step of phase k+1) - (end of the last step of
phase k) - (median steady step: steps 2..K of each phase).

For relayer it also records, per switch, whether the successor was ready at its go (its
``t_prepared`` against the journal's ``phase_started``, written just after the go), how the state
came over (the worker's ``handover`` record, "device" or "checkpoint", and its reason, where the
worker writes them) and the device memory's peak while both phases lived (NVML, every 20 ms);
per phase, the host memory (USS) it held while it waited for its go, against a bare phase
process (imports torch, deepspeed, transformers and initialises CUDA; measured once, or read
from ``--bare-json``); the plan's memory estimate (``orchestrator.estimate``) and ``orchestrator plan``'s
text; and each handed-over switch cut at its go and the successor's read of it, with the journal,
the page cache under writeback, the main threads' kernel waits and py-spy stacks of late ones that
tell the causes of a late piece apart (``_switch_gaps``, ``_switch_probe``). On CUDA, NVML
also records the memory used on the run's devices once each relayer / naive phase is gone; this
process never touches CUDA itself, so it holds no context that would count.

Writes table.md, switch.png and results.json into <--results-dir>/<--out>/ (by default
benchmarks/results/DATE-DEVICE-SHAPE/), refreshed after each way; the scratch folder (runs,
checkpoints; the model unless --model-dir) is removed at the end unless --work names it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import psutil

from _shapes import (
    LAYERS_PER_PHASE, SHAPES, chosen_shape, layer_walk, module_walk, refuse_two_shapes, shape_arguments,
)
from _switch_report import WAYS, plot, relayer_details, summarise, table
from _switch_gaps import analyse
from _switch_probe import StallDump, ThreadWatch
from _switch_watch import (
    DeviceTrace, Devices, DiskWatch, HostWatch, JournalWatch, ManifestWatch, MemInfoWatch, finish_all, leftovers, read_jsonl,
    start_all,
)

ROOT = Path(__file__).resolve().parent.parent
BASELINES = Path(__file__).resolve().parent / "_baselines.py"
RESULTS = Path(__file__).resolve().parent / "results"
ON_CUDA = "1.1b"
"""The shape without --shape or --tiny on CUDA."""


class BenchmarkError(RuntimeError):
    """A way failed; the message names it and carries its log's last lines."""


# -- setup -------------------------------------------------------------------------------------
def nvml():
    """The pynvml module, initialised, or None (no package, no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml if pynvml.nvmlDeviceGetCount() > 0 else None
    except Exception:
        return None


def cuda_available(nv) -> bool:
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return False
    if nv is not None:
        return True
    # cudaGetDeviceCount starts the driver but makes no context, so this process holds no device memory.
    try:
        import torch

        return torch.cuda.device_count() > 0
    except ImportError:
        return False


def hardware(devices: Devices | None) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"cpu": cpu, "cpu_count": os.cpu_count()}
    out["memory_total"] = psutil.virtual_memory().total
    if devices is not None:
        out["gpus"] = devices.describe()
        out["gpu_nvml"] = out["gpus"][0]["name"]
        out["gpu_memory_total"] = out["gpus"][0]["memory_total"]
    return out


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "deepspeed", "transformers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def relayer_source() -> str:
    """The commit measured, and whether relayer's packages had changes on top of it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "orchestrator", "launch", "shard_tools"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{head}{' + uncommitted changes' if dirty else ''}" if head else "unknown"


def write_tokens(path: Path, rows: int, seq_len: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(seq_len)]}) + "\n")


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {type(v).__name__}")


def write_schedule(path: Path, setup: dict) -> None:
    """relayer's schedule for the shared setup (the GPU machine has no tomli_w, hence by hand)."""
    sections = {
        # No final HF model unless asked (peer.py): it is no part of a switch, and at 30B it is 65 GB of writing.
        "run": {"output_dir": "run", "seed": setup["seed"], "final_model": setup.get("final_model", False)},
        "model": {"path": setup["model_dir"], "dtype": setup["dtype"],
                  **({"gradient_checkpointing": True} if setup.get("gradient_checkpointing") else {})},
        "data": {"path": setup["data_path"], "format": "tokens", "seq_len": setup["seq_len"],
                 "batch_size": setup["batch_size"], "micro_batch_size": setup["micro_batch_size"],
                 "shuffle": setup.get("shuffle", True)},
        "optimizer": {"lr": setup["lr"], "weight_decay": setup["weight_decay"], "betas": setup["betas"],
                      "eps": setup["eps"], "grad_clip": setup["grad_clip"]},
        "lr_schedule": {"kind": "constant"},
        "schedule": {"phases": [{k: v for k, v in p.items() if not (k == "layers" and "modules" in p)}
                                for p in setup["phases"]]},
        "deepspeed": {**({"zero_stage": setup["zero_stage"]} if setup.get("zero_stage") is not None else {}),
                      **({"config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}
                         if setup.get("offload_optimizer") else {})},
        "launch": {"launcher": "local", "nproc": setup["nproc"],  # relayer's defaults unless given
                   **{k: setup[k] for k in ("prewarm", "prewarm_depth", "pause_preparing_seconds", "handover",
                                            "device_memory") if setup.get(k) is not None}},
        "checkpoint": {"every_steps": 0, "keep_last": setup.get("keep_last") or 2,
                       **({"every_seconds": setup["every_seconds"]} if setup.get("every_seconds") is not None else {})},
    }
    text = "".join(f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in body.items()) + "\n"
                   for name, body in sections.items())
    path.write_text(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(cuda: bool) -> dict:
    """One process, no launcher: what relayer's "local" launcher sets, plus the repo on the path."""
    path = os.environ.get("PYTHONPATH", "")
    accel = os.environ.get("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": accel,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
            "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def run_logged(argv: list[str], log: Path, what: str, timeout: float, env: dict) -> tuple[float, int]:
    """Runs ``argv`` to its end (its whole session killed on timeout); returns (wall seconds, pid)."""
    t0 = time.time()
    with open(log, "ab") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = f"timeout after {timeout:.0f} s"
    if rc != 0:
        tail = "".join(deque(open(log, errors="replace"), maxlen=25))
        raise BenchmarkError(f"{what} failed ({rc}); last lines of {log}:\n{tail}")
    return time.time() - t0, proc.pid


# -- the three ways ----------------------------------------------------------------------------
def relayer_command() -> list[str]:
    exe = Path(sys.executable).parent / "orchestrator"
    # The GPU machine has the package on PYTHONPATH but no console script.
    return [str(exe)] if exe.exists() else [sys.executable, "-c", "from orchestrator.cli import main; main()"]


def run_relayer(setup: dict, work: Path, devices: Devices | None, timeout: float, bare: dict | None = None) -> dict:
    d = work / "relayer"
    d.mkdir()
    sched = d / "schedule.toml"
    write_schedule(sched, setup)
    run = d / "run"
    host = HostWatch(run)
    probes = switch_probes(run, devices is not None)
    watchers = [host] + ([JournalWatch(devices, run), DeviceTrace(devices)] if devices else []) + list(probes.values())
    disk = DiskWatch(run)
    watchers.append(disk)
    before = devices.sample({"before": True}) if devices else None
    start_all(watchers)
    try:
        wall, _ = run_logged(relayer_command() + ["run", str(sched)], d / "orchestrator.log", "a (relayer)", timeout,
                             child_env(devices is not None))
    finally:
        finish_all(watchers)
    journal = read_jsonl(run / "journal.jsonl")
    records = {e["phase"]: e["records"] for e in journal if e["event"] == "phase_done"}
    phases = [{"phase": k, "layers": p["layers"], **records[k]} for k, p in enumerate(setup["phases"])]
    stages = {k: read_jsonl(run / "phases" / f"phase-{k:04d}" / "stages.jsonl") for k in range(len(phases))}
    trace = watchers[2] if devices else None
    out = {"wall_seconds": wall, "phases": phases, "steps": read_jsonl(run / "metrics.jsonl"), "journal": journal,
           "switch_details": relayer_details(phases, journal, stages, host, trace, bare),
           "plan_estimate": plan_estimate(sched), "plan_text": plan_text(sched, devices, setup.get("device_memory")),
           "disk": disk_summary(disk, probes["manifests"].manifests, wall, len(phases)),
           **probe_results(probes, phases, journal)}
    if devices:
        out["device_before"] = before
        out["device_between_phases"] = [{**s, "leftover": leftovers(s, s["phase_pids"])} for s in watchers[1].samples]
        out["device_trace"] = trace.coarse()
    return out


def disk_summary(disk: DiskWatch, manifests: dict, wall: float, phases: int) -> dict:
    """What the run wrote to its checkpoints and the most its checkpoints folder ever held."""
    written = sum(m["bytes"] for m in manifests.values())
    return {"checkpoints_written": len(manifests), "bytes_written": written, "bytes_per_phase": written / phases,
            "bytes_per_second": written / wall, "peak_checkpoint_bytes": disk.peak, "peak_run_dir_bytes": disk.peak_all}


def switch_probes(run: Path, cuda: bool) -> dict:
    """What is watched around each go (``_switch_probe``, ``_switch_gaps``): the checkpoints' manifests,
    the host's page cache under writeback, the main threads' kernel waits, stacks of late switches."""
    return {"manifests": ManifestWatch(run), "meminfo": MemInfoWatch(),
            "threads": ThreadWatch(run, interval=0.01 if cuda else 0.05), "dumps": StallDump(run)}


def probe_results(probes: dict, phases: list[dict], journal: list[dict]) -> dict:
    manifests = probes["manifests"].manifests
    return {"manifests": manifests, "stall_dumps": probes["dumps"].dumps,
            "switch_gaps": analyse(phases, journal, manifests, probes["threads"], probes["meminfo"]),
            "meminfo_trace": [[round(t, 3), d, w] for t, d, w in probes["meminfo"].trace[::4]]}


def plan_text(sched: Path, devices: Devices | None, budget: str | None = None) -> str | None:
    """``orchestrator plan`` of the schedule, against its ``launch.device_memory`` (``budget``), else
    the device's memory where there is one: each switch's way (device, host or checkpoint) and why,
    and the overlap's planned peak."""
    extra = ["--device-memory", budget or str(devices.describe()[0]["memory_total"])] if budget or devices else []
    try:
        r = subprocess.run(relayer_command() + ["plan", str(sched), *extra], capture_output=True, text=True,
                           timeout=600, cwd=ROOT, env=child_env(devices is not None))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(plan failed: {e})"
    return (r.stdout + r.stderr)[-8000:]


def plan_estimate(sched: Path) -> dict:
    """relayer's memory estimate for the schedule: per phase a process, and the overlap of two
    phases at a switch where ``orchestrator.estimate`` gives one (``PlanEstimate.overlaps``)."""
    try:
        from orchestrator.estimate import estimate_plan
        from orchestrator.plan import plan_phases
        from orchestrator.validate import load_schedule

        loaded = load_schedule(sched)
        est = estimate_plan(loaded, plan_phases(loaded))
    except Exception as e:  # noqa: BLE001 - the estimate is a comparison, never a reason to fail the run
        return {"error": f"{type(e).__name__}: {e}"}
    overlaps = getattr(est, "overlaps", None)
    return {"phases": [m.total for m in est.phases], "phase_max": max(m.total for m in est.phases),
            "overlaps": json.loads(json.dumps(overlaps, default=lambda o: getattr(o, "__dict__", repr(o)))),
            "overlap_text": None if overlaps is None else str(overlaps)[:200]}


def run_inprocess(setup: dict, work: Path, devices: Devices | None, timeout: float, **_) -> dict:
    d = work / "inprocess"
    d.mkdir()
    wall, _ = run_logged([sys.executable, str(BASELINES), "inprocess", setup["setup_path"]], d / "worker.log",
                      "b (inprocess)", timeout, child_env(devices is not None))
    phases = [json.loads((d / f"records-{k:04d}.json").read_text()) for k in range(len(setup["phases"]))]
    return {"wall_seconds": wall, "phases": phases, "steps": read_jsonl(d / "metrics.jsonl")}


def run_naive(setup: dict, work: Path, devices: Devices | None, timeout: float, **_) -> dict:
    d = work / "naive"
    d.mkdir()
    t0 = time.time()
    between = []
    for k in range(len(setup["phases"])):
        argv = [sys.executable, str(BASELINES), "naive", setup["setup_path"], str(k)]
        _, pid = run_logged(argv, d / f"worker-{k:04d}.log", f"c (naive) phase {k}", timeout,
                            child_env(devices is not None))
        if devices:
            sample = devices.sample({"after_phase": k, "phase_pids": [pid]})
            between.append({**sample, "leftover": leftovers(sample, [pid])})
        # Only the newest saved model is read again; dropping older ones keeps the H200 disk use flat.
        shutil.rmtree(d / f"model-{k - 1:04d}", ignore_errors=True)
    phases = [json.loads((d / f"records-{k:04d}.json").read_text()) for k in range(len(setup["phases"]))]
    out = {"wall_seconds": time.time() - t0, "phases": phases, "steps": read_jsonl(d / "metrics.jsonl")}
    if devices:
        out["device_between_phases"] = between
    return out


RUNNERS = {"relayer": run_relayer, "inprocess": run_inprocess, "naive": run_naive}


def write_atomic(path: Path, data: str | bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


# -- entry -------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_arguments(ap, ON_CUDA)
    ap.add_argument("--phases", type=int, help="phases (default: the shape's)")
    ap.add_argument("--steps", type=int, help="optimizer steps a phase (default: the shape's)")
    ap.add_argument("--ways", default="a,b,c", help="which ways, of a (relayer), b (inprocess), c (naive)")
    ap.add_argument("--nproc", type=int, default=1, help="relayer's processes (GPUs) a phase; b and c need 1")
    ap.add_argument("--handover", choices=("auto", "on", "off", "host"), help="relayer's [launch] handover (default: relayer's)")
    ap.add_argument("--device-memory", help="relayer's launch.device_memory, such as 24GiB (issue #42)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="relayer's model.gradient_checkpointing")
    ap.add_argument("--offload-optimizer", action="store_true", help="relayer's optimizer state on the host "
                    "(deepspeed.config.zero_optimization.offload_optimizer, ZeRO 1 or 2)")
    ap.add_argument("--model-dir", type=Path,
                    help="the generated model: reused where it holds this shape, else made there (and kept)")
    ap.add_argument("--bare-json", type=Path, help="the bare phase process's memory: read from here, else measured "
                                                   "and written here")
    ap.add_argument("--prepare-only", action="store_true",
                    help="make the model in --model-dir (and measure into --bare-json), then stop")
    ap.add_argument("--out", help="the results folder's name (default: date, device, shape, processes)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS,
                    help="where that folder goes (default: benchmarks/results)")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a new temporary one, removed at the end)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds any one process may run")
    ap.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3),
                    help="relayer's deepspeed.zero_stage (0: its own AdamW, no ZeRO); b and c run ZeRO-1/2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", choices=("walk", "lisa", "misa"), default="walk",
                    help="the phases' layers: walk (2 a phase in turn, the default) or lisa (sampled with --seed); "
                         "misa: module units to --module-budget of the body's parameters (relayer only, way a)")
    ap.add_argument("--module-budget", type=float, default=0.03, help="with --layers misa: MISA's delta")
    ap.add_argument("--every-seconds", type=float,
                    help="relayer's [checkpoint] every_seconds (default: relayer's; 0: a checkpoint at every phase end)")
    ap.add_argument("--keep-last", type=int, help="relayer's [checkpoint] keep_last (default: 2)")
    ap.add_argument("--prewarm-depth", type=int, help="relayer's [launch] prewarm_depth (default: relayer's)")
    ap.add_argument("--prewarm", choices=("on", "off"), help="relayer's [launch] prewarm (default: relayer's)")
    ap.add_argument("--micro-batch", type=int, help="examples a process's forward pass takes (default: the "
                                                    "shape's; the batch stays, accumulation makes it up)")
    ap.add_argument("--pause-preparing-seconds", type=float,
                    help="relayer's [launch] pause_preparing_seconds (default: relayer's; 0 turns pausing off)")
    args = ap.parse_args(argv)
    bad = [w for w in args.ways.split(",") if w not in WAYS]
    if bad or not args.ways:
        ap.error(f"--ways: expected a comma-separated subset of a,b,c, got {args.ways!r}")
    if args.nproc < 1:
        ap.error(f"--nproc: expected at least 1, got {args.nproc}")
    if args.prepare_only and args.model_dir is None:
        ap.error("--prepare-only: needs --model-dir (where the model is made)")
    refuse_two_shapes(ap, args)
    return args


def chosen_ways(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The ways to run, and a note for each one left out."""
    letters, notes = args.ways.split(","), []
    for letter in ("b", "c"):
        why = ("one process only" if args.nproc > 1 else "ZeRO-1/2 only" if args.zero_stage in (0, 3) else
               "whole layers only" if args.layers == "misa" else None)
        if letter in letters and why:
            letters.remove(letter)
            notes.append(f"way {letter} ({WAYS[letter]}) left out: {why} (--nproc {args.nproc}, "
                         f"--zero-stage {args.zero_stage})")
    return letters, notes


def make_setup(args: argparse.Namespace, shape: dict, work: Path, cuda: bool) -> dict:
    n_phases, steps = args.phases or shape["phases"], args.steps or shape["steps"]
    walk = module_walk(n_phases, shape["model"], args.module_budget, args.seed) if args.layers == "misa" else \
        [{"layers": w} for w in layer_walk(args.layers, n_phases, shape["model"]["num_hidden_layers"], args.seed)]
    return {
        "seed": args.seed, "model_config": shape["model"], "model_dir": str(args.model_dir or work / "model"),
        "data_path": str(work / "train.jsonl"), "work_dir": str(work), "setup_path": str(work / "setup.json"),
        "dtype": "bfloat16" if cuda else "float32", "zero_stage": args.zero_stage, "nproc": args.nproc,
        "prewarm_depth": args.prewarm_depth, "pause_preparing_seconds": args.pause_preparing_seconds,
        "handover": args.handover, "seq_len": shape["seq_len"], "every_seconds": args.every_seconds,
        "keep_last": args.keep_last, "device_memory": args.device_memory,
        "gradient_checkpointing": args.gradient_checkpointing, "offload_optimizer": args.offload_optimizer,
        # The shape's batch is a process's: the global batch grows with the processes, the work of each stays.
        "batch_size": shape["batch_size"] * args.nproc, "micro_batch_size": args.micro_batch or shape["micro_batch_size"],
        "prewarm": None if args.prewarm is None else args.prewarm == "on",
        "lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 1.0,
        "phases": [{"steps": steps, **w} for w in walk], "layer_order": args.layers,
    }


def model_problem(model_dir: Path, setup: dict) -> str | None:
    """Why a model dir that exists cannot be reused for this setup; None where it can."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"{model_dir / 'config.json'}: unreadable ({e})"
    wrong = [f"{k} {config.get(k)!r} (expected {v!r})" for k, v in setup["model_config"].items() if config.get(k) != v]
    dtype = config.get("dtype", config.get("torch_dtype"))
    if dtype not in (None, setup["dtype"]):
        wrong.append(f"dtype {dtype!r} (expected {setup['dtype']!r})")
    return f"{model_dir}: holds another model: {', '.join(wrong)}" if wrong else None


def prepare(args: argparse.Namespace, setup: dict, shape: dict, work: Path, cuda: bool) -> None:
    """The data, and the model unless --model-dir holds it already."""
    write_atomic(work / "setup.json", json.dumps(setup, indent=1))
    rows = min(4096, setup["batch_size"] * len(setup["phases"]) * setup["phases"][0]["steps"])
    write_tokens(Path(setup["data_path"]), rows, shape["seq_len"], shape["model"]["vocab_size"], args.seed)
    model_dir = Path(setup["model_dir"])
    if (model_dir / "config.json").exists():  # main has checked that it holds this shape
        print(f"[switch] reusing the model in {model_dir}", flush=True)
        return
    print(f"[switch] making the base model in {model_dir}", flush=True)
    t0 = time.time()
    run_logged([sys.executable, str(BASELINES), "make-model", setup["setup_path"]], work / "make-model.log",
               "make-model", args.timeout, child_env(cuda))
    print(f"[switch] model made in {time.time() - t0:.1f} s", flush=True)


def bare_process(args: argparse.Namespace, work: Path, cuda: bool) -> dict:
    """What a phase process holds before it holds anything of its own (read from --bare-json if there)."""
    if args.bare_json is not None and args.bare_json.exists():
        return json.loads(args.bare_json.read_text())
    path = args.bare_json or work / "bare.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    run_logged([sys.executable, str(BASELINES), "bare", str(path)], work / "bare.log", "the bare process",
               args.timeout, child_env(cuda))
    return json.loads(path.read_text())


def new_result(name: str, date: dt.datetime, device: str, hw: dict, shape_name: str, shape: dict,
               setup: dict, notes: list[str]) -> dict:
    keys = ("dtype", "zero_stage", "nproc", "handover", "seq_len", "batch_size", "micro_batch_size", "lr", "phases",
            "prewarm", "prewarm_depth", "pause_preparing_seconds", "layer_order", "every_seconds", "keep_last")
    return {
        "name": name, "date": date.isoformat(timespec="seconds"), "device": device, "hardware": hw,
        "versions": {**versions(), "relayer": relayer_source()}, "seconds_total": None,
        # Other work on a shared machine shows in every timing; this says how busy it was.
        "load_average": {"start": os.getloadavg()}, "notes": notes,
        "shape": {"name": shape_name, **{k: setup[k] for k in keys}, "layers_per_phase": LAYERS_PER_PHASE,
                  "model": shape["model"]},
        "ways": {},
    }


def write_results(result: dict, out: Path) -> None:
    write_atomic(out / "results.json", json.dumps(result, indent=1))
    write_atomic(out / "table.md", table(result))
    plot(result, out / "switch.png")


def run_ways(letters: list[str], setup: dict, work: Path, devices: Devices | None, result: dict, out: Path,
             args: argparse.Namespace, t_start: float) -> None:
    for letter in letters:
        way = WAYS[letter]
        print(f"[switch] way {letter} ({way}) ...", flush=True)
        w = RUNNERS[way](setup, work, devices, args.timeout, bare=result.get("bare_process"))
        if "plan_estimate" in w:
            result["plan_estimate"] = w.pop("plan_estimate")
        w.update(summarise(w))
        result["ways"][way] = w
        gpu = [p["device_name"] for p in w["phases"] if p.get("device_name")]
        if devices and gpu:
            result["hardware"]["gpu"] = gpu[0]
        result["seconds_total"] = time.time() - t_start
        result["load_average"]["end"] = os.getloadavg()
        # After every way, so a run cut short by a time limit still leaves what it measured.
        write_results(result, out)
        print(f"[switch] way {letter} ({way}): {w['wall_seconds']:.1f} s, steady step "
              f"{w['steady_step_seconds']:.3f} s, switch overhead median {w['overhead_median_seconds'] or 0:.2f} s, "
              f"max {w['overhead_max_seconds'] or 0:.2f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t_start = time.time()
    nv = nvml()
    cuda = cuda_available(nv)
    devices = Devices(nv, args.nproc) if cuda and nv else None
    shape_name = chosen_shape(args, cuda, ON_CUDA)
    shape, device = SHAPES[shape_name], "cuda" if cuda else "cpu"
    hw = hardware(devices)
    date = dt.datetime.now().astimezone()
    device_slug = hw.get("gpu_nvml", "cuda").lower().replace(" ", "-") if cuda else "cpu"
    name = args.out or f"{date:%Y-%m-%d}-{device_slug}-{shape_name}-{args.nproc}proc"
    work = args.work or Path(tempfile.mkdtemp(prefix="relayer-switch-"))
    work.mkdir(parents=True, exist_ok=True)
    setup = make_setup(args, shape, work, cuda)
    letters, notes = chosen_ways(args)
    result = new_result(name, date, device, hw, shape_name, shape, setup, notes)
    out = args.results_dir / name
    if args.model_dir is not None and (args.model_dir / "config.json").exists():
        problem = model_problem(args.model_dir, setup)
        if problem:
            print(f"switch.py: --model-dir {problem}", file=sys.stderr)
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)
            return 2
    try:
        prepare(args, setup, shape, work, cuda)
        if args.prepare_only:
            if args.bare_json:
                bare_process(args, work, cuda)
            return 0
        out.mkdir(parents=True, exist_ok=True)
        for n in notes:
            print(f"[switch] {n}", flush=True)
        if "a" in letters:
            result["bare_process"] = bare_process(args, work, cuda)
        run_ways(letters, setup, work, devices, result, out, args, t_start)
    except BenchmarkError as e:
        print(f"switch.py: {e}", file=sys.stderr)
        return 1
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"[switch] {result['seconds_total']:.1f} s in all; wrote {out}/table.md, switch.png, results.json",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
