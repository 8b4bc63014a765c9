"""What a layer switch costs: relayer against the two ways people switch today, side by side.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/switch.py --tiny          # ~85 s of CPU time
    python benchmarks/switch.py --phases 8 --steps 20                        # H200 shape (CUDA default)
    python benchmarks/switch.py --tiny --ways a,c --results-dir /tmp          # a subset, into a folder

One model shape, one schedule (phase k trains the head and body layer k mod L), three ways:

  a  relayer    ``orchestrator run`` on a generated schedule: a fresh process per phase
  b  inprocess  one process; per phase a fresh engine on the same model, then engine.destroy(),
                gc.collect(), torch.cuda.empty_cache() (DeepSpeed issue #6729)
  c  naive      a fresh process per phase that loads the whole model with from_pretrained and
                writes it all back with save_pretrained

All three start from the same generated HF model dir (random init), read the same seeded random
token rows in the same order, and use the same batch, ZeRO stage, dtype (bf16 on CUDA, fp32 on
the CPU), client torch AdamW and bucket sizes. Per switch k -> k+1 the overhead is
(end of the first step of phase k+1) - (end of the last step of phase k) - (median steady step).
Memory at each phase start and after the engine is built is torch's allocated / reserved on
CUDA and the process RSS on the CPU. On CUDA, NVML (``pynvml``, package nvidia-ml-py) also
records the memory used on the device by anything once each relayer / naive phase is gone; this
process never touches CUDA itself, so it holds no context that would count.

Writes table.md, switch.png and results.json into <--results-dir>/<--out>/ (by default
benchmarks/results/DATE-DEVICE[-tiny]/), refreshed after each way; the scratch folder (models,
runs, checkpoints) is removed at the end unless --work names it.
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
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINES = Path(__file__).resolve().parent / "_baselines.py"
RESULTS = Path(__file__).resolve().parent / "results"
WAYS = {"a": "relayer", "b": "inprocess", "c": "naive"}

SHAPES = {
    # All three ways take ~85 s of CPU time, nearly all of it imports in 10 fresh processes.
    "tiny": {
        "model": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                  "max_position_embeddings": 64},
        "seq_len": 32, "batch_size": 8, "micro_batch_size": 4, "phases": 4, "steps": 3,
    },
    # TinyLlama-1.1B's shape: the one the +1.35 GB-per-switch leak was measured on.
    "h200": {
        "model": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
                  "max_position_embeddings": 2048},
        "seq_len": 512, "batch_size": 4, "micro_batch_size": 4, "phases": 8, "steps": 20,
    },
}


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


def hardware(nv) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"cpu": cpu, "cpu_count": os.cpu_count()}
    if nv is not None:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        name = nv.nvmlDeviceGetName(h)
        out["gpu_nvml"] = name.decode() if isinstance(name, bytes) else name
        out["gpu_memory_total"] = nv.nvmlDeviceGetMemoryInfo(h).total
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
        "run": {"output_dir": "run", "seed": setup["seed"]},
        "model": {"path": setup["model_dir"], "dtype": setup["dtype"]},
        "data": {"path": setup["data_path"], "format": "tokens", "seq_len": setup["seq_len"],
                 "batch_size": setup["batch_size"], "micro_batch_size": setup["micro_batch_size"], "shuffle": True},
        "optimizer": {"lr": setup["lr"], "weight_decay": setup["weight_decay"], "betas": setup["betas"],
                      "eps": setup["eps"], "grad_clip": setup["grad_clip"]},
        "lr_schedule": {"kind": "constant"},
        "schedule": {"phases": setup["phases"]},
        "deepspeed": {"zero_stage": setup["zero_stage"]},
        "launch": {"launcher": "local", "nproc": 1,  # relayer's defaults unless given
                   **{k: setup[k] for k in ("prewarm_depth", "pause_preparing_seconds") if setup[k] is not None}},
        "checkpoint": {"every_steps": 0, "keep_last": 2},
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


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- device-level check (CUDA) -----------------------------------------------------------------
def device_sample(nv, note: dict) -> dict:
    h = nv.nvmlDeviceGetHandleByIndex(0)
    procs = [{"pid": p.pid, "used": p.usedGpuMemory} for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
    return {"time": time.time(), "used": nv.nvmlDeviceGetMemoryInfo(h).used, "processes": procs, **note}


class JournalWatch(threading.Thread):
    """Samples the device as soon as the journal says a phase's processes are all gone.

    The orchestrator journals phase_done only after reaping the phase; the next phase needs
    seconds of imports before it makes a CUDA context, so a 20 ms poll lands in that gap.
    """

    def __init__(self, nv, run_dir: Path):
        super().__init__(daemon=True, name="journal-watch")
        self.nv, self.run_dir, self.samples = nv, run_dir, []
        self.stop = threading.Event()

    def run(self) -> None:
        offset = 0
        journal = self.run_dir / "journal.jsonl"
        while not self.stop.is_set():
            if journal.exists():
                with open(journal) as f:
                    f.seek(offset)
                    chunk = f.read()
                done = chunk.rfind("\n") + 1
                offset += len(chunk[:done].encode())
                for line in chunk[:done].splitlines():
                    e = json.loads(line)
                    if e["event"] == "phase_done":
                        s = device_sample(self.nv, {"after_phase": e["phase"]})
                        s["phase_pids"] = phase_pids(self.run_dir / "phases" / f"phase-{e['phase']:04d}")
                        self.samples.append(s)
            time.sleep(0.02)


def phase_pids(phase_dir: Path) -> list[int]:
    # The local launcher execs the worker, so "launcher" and "rank-0" can name the same pid.
    return sorted({json.loads(p.read_text())["pid"] for p in (phase_dir / "pids").glob("*.json")})


def leftovers(sample: dict, pids: list[int]) -> list[dict]:
    return [p for p in sample["processes"] if p["pid"] in pids]


# -- the three ways ----------------------------------------------------------------------------
def run_relayer(setup: dict, work: Path, nv, timeout: float) -> dict:
    d = work / "relayer"
    d.mkdir()
    sched = d / "schedule.toml"
    write_schedule(sched, setup)
    exe = Path(sys.executable).parent / "orchestrator"
    # The GPU machine has the package on PYTHONPATH but no console script.
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from orchestrator.cli import main; main()"]
    watch = JournalWatch(nv, d / "run") if nv else None
    before = device_sample(nv, {"before": True}) if nv else None
    if watch:
        watch.start()
    try:
        wall, _ = run_logged(cmd + ["run", str(sched)], d / "orchestrator.log", "a (relayer)", timeout,
                          child_env(nv is not None))
    finally:
        if watch:
            watch.stop.set()
            watch.join()
    run = d / "run"
    journal = read_jsonl(run / "journal.jsonl")
    records = {e["phase"]: e["records"] for e in journal if e["event"] == "phase_done"}
    phases = [{"phase": k, "layers": p["layers"], **records[k]} for k, p in enumerate(setup["phases"])]
    out = {"wall_seconds": wall, "phases": phases, "steps": read_jsonl(run / "metrics.jsonl"), "journal": journal}
    if nv:
        out["device_before"] = before
        out["device_between_phases"] = [{**s, "leftover": leftovers(s, s["phase_pids"])} for s in watch.samples]
    return out


def run_inprocess(setup: dict, work: Path, nv, timeout: float) -> dict:
    d = work / "inprocess"
    d.mkdir()
    wall, _ = run_logged([sys.executable, str(BASELINES), "inprocess", setup["setup_path"]], d / "worker.log",
                      "b (inprocess)", timeout, child_env(nv is not None))
    phases = [json.loads((d / f"records-{k:04d}.json").read_text()) for k in range(len(setup["phases"]))]
    return {"wall_seconds": wall, "phases": phases, "steps": read_jsonl(d / "metrics.jsonl")}


def run_naive(setup: dict, work: Path, nv, timeout: float) -> dict:
    d = work / "naive"
    d.mkdir()
    t0 = time.time()
    between = []
    for k in range(len(setup["phases"])):
        argv = [sys.executable, str(BASELINES), "naive", setup["setup_path"], str(k)]
        _, pid = run_logged(argv, d / f"worker-{k:04d}.log", f"c (naive) phase {k}", timeout,
                            child_env(nv is not None))
        if nv:
            sample = device_sample(nv, {"after_phase": k, "phase_pids": [pid]})
            between.append({**sample, "leftover": leftovers(sample, [pid])})
        # Only the newest saved model is read again; dropping older ones keeps the H200 disk use flat.
        shutil.rmtree(d / f"model-{k - 1:04d}", ignore_errors=True)
    phases = [json.loads((d / f"records-{k:04d}.json").read_text()) for k in range(len(setup["phases"]))]
    out = {"wall_seconds": time.time() - t0, "phases": phases, "steps": read_jsonl(d / "metrics.jsonl")}
    if nv:
        out["device_between_phases"] = between
    return out


RUNNERS = {"relayer": run_relayer, "inprocess": run_inprocess, "naive": run_naive}


# -- summary -----------------------------------------------------------------------------------
def summarise(way: dict) -> dict:
    """Steady step, per-switch overhead and the first step's time, from records and metrics."""
    phases, steps = way["phases"], way["steps"]
    first_step = {}
    for s in steps:
        first_step.setdefault(s["phase"], s["step_seconds"])
    seen, steady = set(), []
    for s in steps:
        if s["phase"] in seen:
            steady.append(s["step_seconds"])
        seen.add(s["phase"])
    steady_s = statistics.median(steady or [s["step_seconds"] for s in steps])
    switches = []
    for prev, nxt in zip(phases, phases[1:]):
        gap = nxt["t_first_step_end"] - prev["t_last_step_end"]
        switches.append({"from": prev["phase"], "to": nxt["phase"], "gap_seconds": gap,
                         "overhead_seconds": gap - steady_s})
    for p in phases:
        p["first_step_seconds"] = first_step.get(p["phase"])
    overheads = [s["overhead_seconds"] for s in switches]
    return {"steady_step_seconds": steady_s, "switches": switches,
            "overhead_mean_seconds": statistics.mean(overheads) if overheads else None}


def mem_main(m: dict) -> float:
    """The one number per memory sample that the plot and table lead with."""
    return m["allocated"] if "allocated" in m else m["rss"]


def fmt_mem(m: dict | float | None) -> str:
    if m is None:
        return "-"
    if isinstance(m, (int, float)):
        return f"{m / 1e6:.0f}"
    if "allocated" in m:
        return f"{m['allocated'] / 1e6:.0f} / {m['reserved'] / 1e6:.0f}"
    return f"{m['rss'] / 1e6:.0f}"


def fmt_load(load) -> str:
    return "-" if load is None else ", ".join(f"{x:.1f}" for x in load)


def table(result: dict) -> str:
    ways = result["ways"]
    names = [n for n in WAYS.values() if n in ways]
    cuda = result["device"] == "cuda"
    unit = "MB allocated / reserved (torch)" if cuda else "MB RSS of the phase's process"
    s = result["shape"]
    lines = [
        f"# Layer switch: {', '.join(names)} ({result['name']})", "",
        f"- date: {result['date']}",
        f"- hardware: {result['hardware'].get('gpu') or result['hardware'].get('gpu_nvml') or 'no GPU'}; CPU {result['hardware']['cpu']} "
        f"({result['hardware']['cpu_count']} cores); load average (1, 5, 15 min) at start "
        f"{fmt_load(result['load_average']['start'])}, at end {fmt_load(result['load_average'].get('end'))}",
        f"- {result['seconds_total']:.0f} s in all (making the base model, then the ways one after another)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        f"- shape: Llama hidden {s['model']['hidden_size']}, {s['model']['num_hidden_layers']} layers, "
        f"intermediate {s['model']['intermediate_size']}, {s['model']['num_attention_heads']} heads "
        f"({s['model']['num_key_value_heads']} kv), vocab {s['model']['vocab_size']}; {s['dtype']}, "
        f"ZeRO-{s['zero_stage']}, batch {s['batch_size']} (micro {s['micro_batch_size']}) x {s['seq_len']} tokens; "
        f"{len(s['phases'])} phases x {s['phases'][0]['steps']} steps, one body layer a phase",
        f"- overhead = end of phase k+1's first step - end of phase k's last step - one steady step "
        f"(median of all but each phase's first step); memory in {unit}"
        + ("" if cuda else " (peak: RSS at the phase's end)"),
        "- inprocess keeps one model object, so its weights count in its phase starts from phase 1 on;"
        " only relayer carries the head's optimizer state across phases (the others start it afresh)",
        "", "| way | steady step (s) | mean switch overhead (s) | total wall (s) |", "| --- | ---: | ---: | ---: |",
    ]
    for n in names:
        w = ways[n]
        ov = w["overhead_mean_seconds"]
        lines.append(f"| {n} | {w['steady_step_seconds']:.3f} | {'-' if ov is None else f'{ov:.2f}'} | "
                     f"{w['wall_seconds']:.1f} |")
    lines += ["", "Switch overhead (s):", "", "| switch | " + " | ".join(names) + " |",
              "| --- |" + " ---: |" * len(names)]
    for i in range(len(s["phases"]) - 1):
        cells = [f"{ways[n]['switches'][i]['overhead_seconds']:.2f}" for n in names]
        lines.append(f"| {i} -> {i + 1} | " + " | ".join(cells) + " |")
    lines += ["", f"Memory per phase ({unit}): at phase start / after the engine is built / peak:", "",
              "| phase | layer | " + " | ".join(f"{n} start | {n} engine | {n} peak" for n in names) + " |",
              "| ---: | ---: |" + " ---: | ---: | ---: |" * len(names)]
    for k, ph in enumerate(s["phases"]):
        cells = []
        for n in names:
            p = ways[n]["phases"][k]
            cells += [fmt_mem(p["memory_start"]), fmt_mem(p["memory_engine"]), fmt_mem(p["memory_peak"])]
        lines.append(f"| {k} | {ph['layers'][0]} | " + " | ".join(cells) + " |")
    checks = [(n, ways[n]["device_between_phases"]) for n in names if "device_between_phases" in ways[n]]
    if checks:
        lines += ["", "Device memory used by anything (NVML) once each phase's processes are gone: MB used, "
                      "compute processes on the device (a pre-started successor counts), and how many of them "
                      "belong to the finished phase (must be 0):", "",
                  "| after phase | " + " | ".join(n for n, _ in checks) + " |", "| ---: |" + " ---: |" * len(checks)]
        for k in range(len(s["phases"])):
            cells = []
            for _, samples in checks:
                hit = [x for x in samples if x["after_phase"] == k]
                cells.append(f"{hit[0]['used'] / 1e6:.0f} MB, {len(hit[0]['processes'])} procs, "
                             f"{len(hit[0].get('leftover', []))} left" if hit else "-")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        before = ways.get("relayer", {}).get("device_before")
        if before:
            lines.append(f"\nBefore relayer's run: {before['used'] / 1e6:.0f} MB used, "
                         f"{len(before['processes'])} compute processes.")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = result["ways"]
    names = [n for n in WAYS.values() if n in ways]
    cuda = result["device"] == "cuda"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, key in enumerate(("memory_start", "memory_engine")):
        ax = axes[i]
        for n in names:
            ph = ways[n]["phases"]
            line, = ax.plot([p["phase"] for p in ph], [mem_main(p[key]) / 1e6 for p in ph], marker="o",
                            label=n + (" allocated" if cuda else ""))
            if cuda:
                ax.plot([p["phase"] for p in ph], [p[key]["reserved"] / 1e6 for p in ph], ls="--",
                        color=line.get_color(), label=f"{n} reserved")
        ax.set_title("memory at phase start" if key == "memory_start" else "memory after engine build")
        ax.set_xticks(range(len(result["shape"]["phases"])))
        ax.set_xlabel("phase")
        ax.set_ylabel("MB (torch, device)" if cuda else "MB (process RSS)")
        ax.legend(fontsize=8)
    ax = axes[2]
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        sw = ways[n]["switches"]
        ax.bar([s["from"] + (j - (len(names) - 1) / 2) * width for s in sw], [s["overhead_seconds"] for s in sw],
               width=width, label=n)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_title("switch overhead (beyond one steady step)")
    switches = range(len(result["shape"]["phases"]) - 1)
    ax.set_xticks(list(switches), [f"{k}->{k + 1}" for k in switches])
    ax.set_xlabel("switch")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    hw = result["hardware"].get("gpu") or result["hardware"]["cpu"]
    fig.suptitle(f"{result['name']}: {hw}, {result['shape']['dtype']}, ZeRO-{result['shape']['zero_stage']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_atomic(path: Path, data: str | bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


# -- entry -------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU-sized shape (default without CUDA)")
    ap.add_argument("--phases", type=int, help="phases (default: the shape's)")
    ap.add_argument("--steps", type=int, help="optimizer steps a phase (default: the shape's)")
    ap.add_argument("--ways", default="a,b,c", help="which ways, of a (relayer), b (inprocess), c (naive)")
    ap.add_argument("--out", help="the results folder's name (default: date, device and shape)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS,
                    help="where that folder goes (default: benchmarks/results)")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a new temporary one, removed at the end)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds any one process may run")
    ap.add_argument("--zero-stage", type=int, default=2, choices=(1, 2))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prewarm-depth", type=int, help="relayer's [launch] prewarm_depth (default: relayer's)")
    ap.add_argument("--pause-preparing-seconds", type=float,
                    help="relayer's [launch] pause_preparing_seconds (default: relayer's; 0 turns pausing off)")
    args = ap.parse_args(argv)
    bad = [w for w in args.ways.split(",") if w not in WAYS]
    if bad or not args.ways:
        ap.error(f"--ways: expected a comma-separated subset of a,b,c, got {args.ways!r}")
    return args


def write_results(result: dict, out: Path) -> None:
    write_atomic(out / "results.json", json.dumps(result, indent=1))
    write_atomic(out / "table.md", table(result))
    plot(result, out / "switch.png")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t_start = time.time()
    nv = nvml()
    cuda = cuda_available(nv)
    nv = nv if cuda else None
    shape_name = "tiny" if args.tiny or not cuda else "h200"
    shape = SHAPES[shape_name]
    device = "cuda" if cuda else "cpu"
    hw = hardware(nv)
    date = dt.datetime.now().astimezone()
    device_slug = hw.get("gpu_nvml", "cuda").lower().replace(" ", "-") if cuda else "cpu"
    name = args.out or f"{date:%Y-%m-%d}-{device_slug}" + ("-tiny" if shape_name == "tiny" else "")
    out = args.results_dir / name
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="relayer-switch-"))
    work.mkdir(parents=True, exist_ok=True)
    n_phases, steps = args.phases or shape["phases"], args.steps or shape["steps"]
    layers = shape["model"]["num_hidden_layers"]
    setup = {
        "seed": args.seed, "model_config": shape["model"], "model_dir": str(work / "model"),
        "data_path": str(work / "train.jsonl"), "work_dir": str(work), "setup_path": str(work / "setup.json"),
        "dtype": "bfloat16" if cuda else "float32", "zero_stage": args.zero_stage, "prewarm_depth": args.prewarm_depth,
        "pause_preparing_seconds": args.pause_preparing_seconds,
        "seq_len": shape["seq_len"], "batch_size": shape["batch_size"], "micro_batch_size": shape["micro_batch_size"],
        "lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 1.0,
        "phases": [{"steps": steps, "layers": [k % layers]} for k in range(n_phases)],
    }
    result = {
        "name": name, "date": date.isoformat(timespec="seconds"), "device": device, "hardware": hw,
        "versions": {**versions(), "relayer": relayer_source()}, "seconds_total": None,
        # Other work on a shared machine shows in every timing; this says how busy it was.
        "load_average": {"start": os.getloadavg()},
        "shape": {"name": shape_name, **{k: setup[k] for k in ("dtype", "zero_stage", "seq_len", "batch_size",
                                                                 "micro_batch_size", "lr", "phases", "prewarm_depth",
                                                                 "pause_preparing_seconds")},
                  "model": shape["model"]},
        "ways": {},
    }
    try:
        write_atomic(work / "setup.json", json.dumps(setup, indent=1))
        rows = min(4096, shape["batch_size"] * n_phases * steps)
        write_tokens(Path(setup["data_path"]), rows, shape["seq_len"], shape["model"]["vocab_size"], args.seed)
        print(f"[switch] {shape_name} shape on {device}; making the base model in {work}", flush=True)
        run_logged([sys.executable, str(BASELINES), "make-model", setup["setup_path"]], work / "make-model.log",
                   "make-model", args.timeout, child_env(cuda))
        for letter in args.ways.split(","):
            way = WAYS[letter]
            print(f"[switch] way {letter} ({way}) ...", flush=True)
            w = RUNNERS[way](setup, work, nv, args.timeout)
            w.update(summarise(w))
            result["ways"][way] = w
            gpu = [p["device_name"] for p in w["phases"] if p.get("device_name")]
            if cuda and gpu:
                hw["gpu"] = gpu[0]
            result["seconds_total"] = time.time() - t_start
            result["load_average"]["end"] = os.getloadavg()
            # After every way, so a run cut short by a time limit still leaves what it measured.
            write_results(result, out)
            print(f"[switch] way {letter} ({way}): {w['wall_seconds']:.1f} s, steady step "
                  f"{w['steady_step_seconds']:.3f} s, mean switch overhead {w['overhead_mean_seconds'] or 0:.2f} s",
                  flush=True)
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
